"""The decoder's shape, read from a Hugging Face ``config.json`` (Llama, Qwen3, Gemma 3)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

def read_config_json(folder: str, what: str) -> dict:
    """``folder/config.json`` as a dict; ``what`` names the folder in the error (e.g. "DFlash checkpoint")."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {folder!r} has no config.json")
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelArchConfig:
    """The decoder's shape, read from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Gemma 3 (None / defaults elsewhere): per layer "sliding_attention" or "full_attention", the
    # window of the sliding layers and their RoPE base, the score scale's 1/√ argument, the
    # final logits' tanh soft cap, and the MLP's activation.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # MTP modules stored after the decoder layers (model.layers.{N + i}): the target skips them
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", ""), str(cfg.get("model_type")))
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        # transformers 5 keeps RoPE per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
        local_rope = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention", rope)
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            **_gemma3_fields(cfg, arch, local_rope),
        )

    @classmethod
    def from_folder(cls, folder: str) -> "ModelArchConfig":
        return cls.from_hf_config(read_config_json(folder, "model folder"))


_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma 3 configs that list no layer_types: every sliding_window_pattern-th layer is global; the
# sliding layers' RoPE base where a config gives none (also what llama.cpp uses for GGUF files).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma3_fields(cfg: dict, arch: str, local_rope: dict) -> dict:
    """ModelArchConfig's Gemma 3 fields from a Hugging Face config (none for other architectures)."""
    if arch != "Gemma3ForCausalLM":
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({layers}), got {types!r}")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 configs leave it null)")
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        layer_types=tuple(types),
        sliding_window=int(cfg["sliding_window"]),
        rope_local_theta=float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_activation=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
    )
