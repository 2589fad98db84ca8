"""Dense, trainable layers shared by the drafters' training models, with the serving layers'
math and parameter names (so a ``state_dict`` is the public checkpoint's)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.config import ModelArchConfig


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
