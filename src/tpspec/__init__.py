"""tpspec: a compact tensor-parallel LLM inference engine built around speculative decoding."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import tpspec` stays cheap (and torch-free) for the CLI's argument parsing.
    if name == "LLM":
        from tpspec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tpspec.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
