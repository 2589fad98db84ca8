"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama/Qwen3)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from tpspec.layers import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [head_dim/2]
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; allowed: {SUPPORTED_ROPE_TYPES}")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RopeAngles(NamedTuple):
    """The rotation of one step's tokens, computed once and shared by every layer."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim] cos(pθ)
    sin: torch.Tensor  # [num_tokens, 1, head_dim] sin(pθ), first half negated (the rotate-half sign)


class RotaryEmbedding(nn.Module):
    """x' = x·cos(pθ) + rotate_half(x)·sin(pθ) for query and key heads at positions p.

    rotate_half(x)·sin = roll(x, head_dim/2)·[-sin | sin]: the sign lives in the ``sin`` table,
    so a rotation is one roll and three elementwise ops, rounded as Hugging Face's.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]  # [max_pos, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])  # [head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", emb.sin() * sign, persistent=False)  # [max_pos, head_dim], signed

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """positions: [num_tokens] -> their cos/sin in ``dtype`` (that of the heads they rotate).
        (``index_select``: the rows ``self.cos[positions]`` gives, at a third of its cost on a
        decode step's few positions, 18 -> 9 us.)"""
        cos, sin = self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)
        return RopeAngles(cos if cos.dtype == dtype else cos.to(dtype), sin if sin.dtype == dtype else sin.to(dtype))

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions: [num_tokens]; x: [num_tokens, heads, head_dim] -> x rotated by its positions."""
        return apply_rope(x, self.angles(positions, x.dtype))


def apply_rope(x: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> x rotated by its tokens' angles (float32 on CPU: one call
    of the kernel ``rotary``, the same bits as the ops below)."""
    kernels = cpu_kernels.usable(x, rope.cos, rope.sin)
    if (kernels is not None and x.shape[-1] % 16 == 0 and x.stride(-1) == 1 and rope.cos.is_contiguous()
            and rope.sin.is_contiguous() and rope.cos.numel() == rope.sin.numel() == x.shape[0] * x.shape[-1]):
        return kernels.rotary(x, rope.cos, rope.sin)
    return x * rope.cos + x.roll(x.shape[-1] // 2, -1) * rope.sin
