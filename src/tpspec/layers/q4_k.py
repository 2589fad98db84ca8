"""Q4_K weights (Gemma 3 270M's o projections and half its down projections): llama.cpp's format,
super-blocks of 256 weights in 8 groups of 32, w = d·sc·q − dmin·m with a 4-bit q, float16 d and
dmin per super-block and 6-bit sc and m per group. Per group that is w = D·q + M with D = d·sc and
M = −dmin·m: Q4_1's form, but D and M are a float16 times a 6-bit integer, float32 values that are
not float16 ones. ``exact_groups`` recovers such groups from the float32 weights the loader gives
(any D, M and q in 0..15 that give every weight exactly; None where there are none: nothing is
re-quantized), and the integer kernels take them in Q4_1's layout with float32 scales
(``int8_dot.quantize_exact_q4_k``): 0.75 bytes a weight against float16's 2.
"""

from __future__ import annotations

import torch

from tpspec.layers.finest_grid import finest_grid
from tpspec.layers.row_chunks import by_row_chunks

GROUP = 32  # weights per group (one D and one M)
Q_MAX = 15  # q runs over 0..15


@by_row_chunks
def exact_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w`` ([out, in] float32) as 4-bit groups if every group is exactly D·q + M with float32 D ≥ 0
    and M and q in 0..15: D, M [out, groups] float32 and q [out, groups, 32] uint8; else None.
    M is the group's least weight and D its span over the most levels n ≤ 15 that keep every
    weight on the grid (the span is D·(q_max − q_min) of the format's own q; a finer grid is found
    first where it fits). Checked in float64, where the differences and sums of a group's float32
    values are exact unless they span more than 29 binades."""
    out_features, in_features = w.shape
    groups = w.detach().double().view(out_features, in_features // GROUP, GROUP)
    low = groups.amin(-1)  # [out, groups]: M
    above = groups - low[..., None]  # [out, groups, 32] ≥ 0, exact in float64
    d, q, found = finest_grid(above, above.amax(-1), Q_MAX)  # a constant group: D = 0, q = 0
    if not found.all():
        return None
    if not torch.equal(q * d[..., None] + low[..., None], groups):  # M + D·q gives every weight exactly
        return None
    return d.float().contiguous(), low.float().contiguous(), q.to(torch.uint8)
