"""Dense, trainable layers shared by the drafters' training models, with the serving layers'
math and parameter names (so a ``state_dict`` is the public checkpoint's)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.config import ModelArchConfig
from tpspec.layers.rotary import RotaryEmbedding


def plain_draft_arch(target: ModelArchConfig, architecture: str, num_layers: int) -> ModelArchConfig:
    """The target's shape without its own style, for ``num_layers`` draft layers: SiLU, full
    attention, one RoPE base, no query scalar or logit soft cap, untied embeddings."""
    return dataclasses.replace(
        target, architecture=architecture, num_hidden_layers=num_layers, tie_word_embeddings=False,
        layer_types=None, sliding_window=None, rope_local_theta=None, query_pre_attn_scalar=None,
        final_logit_softcapping=None, hidden_activation="silu",
    )


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w, in float32 like the serving RMSNorm."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, a: ModelArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ChainAttention(nn.Module):
    """A chain head's attention under the training-time test (EAGLE-3, MTP): step 0's rows attend
    causally to each other; a row of step j ≥ 1 (the chain from origin t) attends to the step-0 rows
    at positions ≤ t and to its own chain's rows of steps 1 … j, as the serving head's paged cache
    holds them. Inputs ``in_features`` wide; q/k RMSNorms per head (Qwen3 style) with ``qk_norm``."""

    def __init__(self, a: ModelArchConfig, in_features: int, qk_norm: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps), RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, positions, rotary: RotaryEmbedding, base: tuple | None, chain: list[tuple]):
        """x: [B, T, in_features] at positions [B, T]. ``base``: the step-0 (keys, values) [B, heads, T, d],
        None at step 0 (which makes them); ``chain``: this chain's (key, value) of steps 1 … j − 1.
        Returns (output [B, T, H], this step's (key, value)); the step's own key is attended too."""
        b, t, _ = x.shape
        d, rep = self.head_dim, self.heads // self.kv_heads
        pos = positions.reshape(-1)
        q, k = self.q_proj(x).view(-1, self.heads, d), self.k_proj(x).view(-1, self.kv_heads, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary.rotate(pos, q).view(b, t, self.heads, d).transpose(1, 2)
        k = rotary.rotate(pos, k).view(b, t, self.kv_heads, d)
        k = k.transpose(1, 2).repeat_interleave(rep, 1)  # [B, heads, T, d]
        v = self.v_proj(x).view(b, t, self.kv_heads, d).transpose(1, 2).repeat_interleave(rep, 1)
        if base is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, d]
        else:
            k0, v0 = base
            keys, values = [kv[0] for kv in chain] + [k], [kv[1] for kv in chain] + [v]
            scale = d**-0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, heads, T, T]
            diag = torch.stack([(q * kj).sum(-1) for kj in keys], -1) * scale  # [B, heads, T, j]
            p = torch.cat([s0, diag], -1).float().softmax(-1).to(q.dtype)
            out = p[..., :t] @ v0 + (p[..., t:, None] * torch.stack(values, -2)).sum(-2)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * d)), (k, v)
