"""``--speculative-config``: which drafting method, how many drafts, and how they are picked (JSON keys named as in vLLM)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tpspec.config.checks import check_int
from tpspec.config.speculative_methods import SpeculativeMethod, get_method

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: JSON keys named as in vLLM."""

    method: str  # a name (or alias) of the methods table, ``config.speculative_methods``
    # The most drafts a request verifies per step. None: the method's default, which the drafter
    # resolution fills in before the engine starts (``spec_decode.resolve``).
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft checkpoint (.gguf or folder) for model-based methods
    use_local_argmax_reduction: bool = False
    draft_sample_method: str = "greedy"
    draft_tensor_parallel_size: int | None = None  # None = the target's
    prompt_lookup_min: int | None = None  # ngram
    prompt_lookup_max: int | None = None  # ngram
    # True: num_speculative_tokens is the most drafts a request verifies per step and the engine
    # chooses how many (engine.speculation.controller); false: always num_speculative_tokens (vLLM's
    # behaviour). None (unset): adaptive unless a per-batch-size schedule is given.
    adaptive: bool | None = None
    # vLLM's static schedule: ``[start, end, k]`` rows, batch sizes start..end (inclusive) speculate k
    # tokens (0: none); other batch sizes speculate num_speculative_tokens.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    # The adaptive controller's starting estimate of the acceptance rate at draft positions 1, 2, …
    # (each given the ones before accepted; later positions as the last). None: what the drafter's
    # folder says it measured (``acceptance.json``, filled in by the drafter resolution), else 0.4
    # (``engine.speculation.acceptance.PRIOR``). Measured rates take over as requests verify drafts.
    acceptance_prior: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        method = self.method_spec  # an unknown method raises here
        if self.num_speculative_tokens is None and method.default_num_speculative_tokens is not None:
            object.__setattr__(self, "num_speculative_tokens", method.default_num_speculative_tokens)
        if self.num_speculative_tokens is not None:
            check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        elif not method.uses_model:  # no drafter to say how many drafts it was trained for
            raise ValueError(f"speculative_config.num_speculative_tokens is required for method {self.method!r}")
        self._validate_speculation_length()
        if self.acceptance_prior is not None:
            prior = self.acceptance_prior
            if (not isinstance(prior, (list, tuple)) or not prior
                    or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < a < 1 for a in prior)):
                raise ValueError(f"speculative_config.acceptance_prior must be a non-empty list of rates in (0, 1), got {prior!r}")
            object.__setattr__(self, "acceptance_prior", tuple(float(a) for a in prior))
        if not isinstance(self.use_local_argmax_reduction, bool):
            raise ValueError(
                f"speculative_config.use_local_argmax_reduction must be true or false, got {self.use_local_argmax_reduction!r}"
            )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path string, got {self.model!r}")
        if self.draft_tensor_parallel_size is not None:
            check_int("speculative_config.draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1, 64)
        if not method.uses_model:
            self._validate_modelless()
        elif self.model is None and not method.model_optional:
            raise ValueError(
                f"speculative_config.model is required for method {self.method!r} (a draft checkpoint: "
                f"a .gguf file or a model folder), got None"
            )
        if method.prompt_lookup:
            lo = 2 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(lo, 4) if self.prompt_lookup_max is None else self.prompt_lookup_max
            check_int("speculative_config.prompt_lookup_min", lo, 1, 64)
            check_int("speculative_config.prompt_lookup_max", hi, 1, 64)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"speculative_config.{key} only applies to a method that looks drafts up in the tokens "
                        f"(ngram), got {getattr(self, key)!r} with method {self.method!r}"
                    )

    @property
    def method_spec(self) -> SpeculativeMethod:
        """The method's row in the methods table (``config.speculative_methods``)."""
        return get_method(self.method)

    def _validate_modelless(self) -> None:
        """The keys that only apply to a draft model, for a method with none."""
        if self.model is not None:
            raise ValueError(
                f"speculative_config.model must not be set for method {self.method!r} (it uses no model), "
                f"got {self.model!r}"
            )
        if self.draft_tensor_parallel_size is not None:
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size only applies to a draft model; method {self.method!r} "
                f"has none, got {self.draft_tensor_parallel_size}"
            )
        if self.use_local_argmax_reduction:
            raise ValueError(
                f"speculative_config.use_local_argmax_reduction=true needs a draft model's LM head; "
                f"method {self.method!r} has no model"
            )
        if self.draft_sample_method != "greedy":
            raise ValueError(
                f"speculative_config.draft_sample_method must be 'greedy' for method {self.method!r}, "
                f"got {self.draft_sample_method!r}"
            )

    def _validate_speculation_length(self) -> None:
        schedule = self.num_speculative_tokens_per_batch_size
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if schedule is None:
            object.__setattr__(self, "adaptive", self.adaptive is not False)
            return
        key = "speculative_config.num_speculative_tokens_per_batch_size"
        if self.adaptive:
            raise ValueError(f"{key} is a static schedule: it cannot be combined with speculative_config.adaptive=true")
        if not isinstance(schedule, (list, tuple)) or not schedule:
            raise ValueError(f"{key} must be a non-empty list of [start, end, k] rows, got {schedule!r}")
        rows = []
        for row in schedule:
            if not isinstance(row, (list, tuple)) or len(row) != 3:
                raise ValueError(f"{key} rows must be [start, end, k], got {row!r}")
            start, end, k = row
            check_int(f"{key} start", start, 1)
            check_int(f"{key} end", end, start)
            check_int(f"{key} k", k, 0, self.num_speculative_tokens)
            rows.append((start, end, k))
        rows.sort()
        for (_, end, _), (start, _, _) in zip(rows, rows[1:]):
            if start <= end:
                raise ValueError(f"{key} rows overlap at batch size {start}: {schedule!r}")
        object.__setattr__(self, "num_speculative_tokens_per_batch_size", tuple(rows))
        object.__setattr__(self, "adaptive", False)

    def k_for_batch_size(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` requests when k is not adaptive."""
        for start, end, k in self.num_speculative_tokens_per_batch_size or ():
            if start <= batch_size <= end:
                return k
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, d: "dict | str") -> "SpeculativeConfig":
        """From a dict or a JSON string; unknown keys and wrong types raise ``ValueError``."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {sorted(known)}")
        if "method" not in d:
            raise ValueError("speculative_config.method is required")
        return cls(**d)
