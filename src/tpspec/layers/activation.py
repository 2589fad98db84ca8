"""SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpspec.layers import cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2·d] = [gate | up] -> silu(gate) · up: [num_tokens, d] (contiguous float32 on
    CPU: one call of the kernel ``silu_and_mul``, within an ulp or two of the ops below)."""
    d = x.shape[-1] // 2
    kernels = cpu_kernels.usable(x)
    if kernels is not None and x.dim() == 2 and d % 8 == 0 and x.is_contiguous():
        return kernels.silu_and_mul(x)
    return F.silu(x[..., :d]) * x[..., d:]
