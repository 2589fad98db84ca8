"""Q8_0 weights kept 8-bit: llama.cpp's format, 32 weights a group, w = d·q (q an 8-bit signed integer,
d float16). The default model's GGUF stores its token embedding, which is also its LM head, so;
``exact_groups`` recovers such groups from the float32 weight (None where a weight is not exactly
Q8_0), ``quantize_exact`` lays them out for ``q8_0_linear``, which multiplies float32 activations
by them reading 1.06 bytes a weight against float16's 2, through tpspec's kernel
(``csrc/q8_0_linear.cpp``, one of ``cpu_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpspec.layers import cpu_kernels
from tpspec.layers.row_chunks import by_row_chunks

GROUP = 32  # weights per group (one d)
Q_MAX = 127  # llama.cpp's Q8_0: d = max |w| / 127, q = round(w / d)


@dataclass(frozen=True)
class Q8_0Weight:
    """An ``[out_features, in_features]`` weight in the kernel's layout (``csrc/q8_0_linear.cpp``)."""

    qweight: torch.Tensor  # [out_features, in_features] int8: q
    scales: torch.Tensor  # [out_features, in_features / 32] float16: d


@by_row_chunks
def exact_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` ([out, in] float32) as Q8_0 groups if every group is exactly d·q with a float16 d and q in
    -127..127, as llama.cpp rounds (d = max |w| / 127): d [out, groups] float16 and q [out, groups, 32]
    int8; else None."""
    out_features, in_features = w.shape
    multiples = group_multiples(w.detach().view(out_features, in_features // GROUP, GROUP), Q_MAX)
    if multiples is None or not multiples[2].all():
        return None
    d, q, _ = multiples
    return d.contiguous(), q.to(torch.int8)


def quantize_exact(w: torch.Tensor) -> Q8_0Weight | None:
    """``w`` ([out, in] float32) in the kernel's layout if it is exactly Q8_0 (``exact_groups``), else None."""
    return laid_out(exact_groups(w))


def laid_out(groups: tuple[torch.Tensor, torch.Tensor] | None) -> Q8_0Weight | None:
    """Whole-number groups (d [out, groups] float16, q [out, groups, 32] int8; None: none) in the
    kernel's layout."""
    if groups is None:
        return None
    d, q = groups
    return Q8_0Weight(q.flatten(1).contiguous(), d)


def group_multiples(groups: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """groups [..., 32] float32 as whole multiples of d = max |w| / levels (float16), as llama.cpp
    picks Q8_0's d (levels 127) and |Q5_0's| (16): d [...] float16, q [..., 32] float32 in
    −levels..levels, and [...] whether d·q gives each group exactly; None where a d is not finite."""
    d = (groups.abs().amax(-1) / levels).half()
    if not torch.isfinite(d).all():
        return None
    step = torch.where(d == 0, torch.ones_like(d), d).float()[..., None]
    q = torch.round(groups / step).clamp(-levels, levels)
    return d, q, (q * d.float()[..., None] == groups).all(-1)


def dequantize(weight: Q8_0Weight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``weight`` holds (the reference of the kernel's tests)."""
    q = weight.qweight.float().view(weight.qweight.shape[0], -1, GROUP)
    return (weight.scales.float()[..., None] * q).flatten(1)


def q8_0_linear(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """x: [num_rows, in_features] -> x · dequantize(weight)ᵀ: [num_rows, out_features] in x's dtype."""
    out = cpu_kernels.kernels().q8_0_linear(x.float().contiguous(), weight.qweight, weight.scales, cpu_kernels.wide())
    return out.to(x.dtype)
