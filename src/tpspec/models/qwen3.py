"""Qwen3: the Llama decoder with RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from tpspec.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
