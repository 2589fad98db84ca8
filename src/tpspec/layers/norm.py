"""RMSNorm, computed in float32 like the reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.layers import cpu_kernels


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w, optionally after adding a residual (returned too)."""

    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(loaded[:])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As Hugging Face rounds it: normalized in float32, rounded to x's dtype, then scaled.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., hidden_size]. With ``residual``: returns (norm(x + residual), x + residual).
        A float32 [tokens, hidden] on CPU: one call to ``cpu_kernels``' add_rms_norm where they
        are loaded."""
        kernels = cpu_kernels.usable(x, residual, self.weight)
        if kernels is not None and x.dim() == 2 and x.shape[1] % 8 == 0 and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            out, total = kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
