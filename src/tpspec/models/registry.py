"""Architecture name (``config.json`` ``architectures[0]``) -> model class."""

from __future__ import annotations

from tpspec.models.gemma3 import Gemma3ForCausalLM
from tpspec.models.llama import LlamaForCausalLM
from tpspec.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
