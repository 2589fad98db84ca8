"""Q6_K weights (Gemma 3 270M's down projections in half its layers): llama.cpp's format,
super-blocks of 256 weights in 16 sub-blocks of 16, w = d·sc·(q − 32) with a 6-bit q, a float16 d
per super-block and an 8-bit sc per sub-block. Per 16 weights that is w = S·k with S = d·sc (a
float32 value that is not a float16 one) and k a whole number in −32..31. ``exact_groups`` recovers
such halves of 32-weight groups from the float32 weights the loader gives (None where a weight is
not such: nothing is re-quantized), and the integer kernels take them in Q8_0's layout with a
float32 scale (and Σ k) per 16 weights (``int8_dot.quantize_exact_q6_k``): 1.38 bytes a weight
against float16's 2.
"""

from __future__ import annotations

import torch

from tpspec.layers.finest_grid import finest_grid
from tpspec.layers.row_chunks import by_row_chunks

GROUP = 32  # weights per group of the kernels' layout
HALF = 16  # weights per scale
K_MAX = 32  # |k| ≤ 32


@by_row_chunks
def exact_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` ([out, in] float32) as groups of two 16-weight halves if every half is exactly S·k with a
    float32 S ≥ 0 and whole numbers |k| ≤ 32: S [out, groups, 2] float32 and k [out, groups, 32] int8;
    else None. S is the half's largest magnitude over the most levels n ≤ 32 that keep every weight
    on the grid (n = |k| of that weight in the format's own k: the finest grid that fits). Checked
    exactly, in float64 (S·k of a float32 S and |k| ≤ 32 is exact there)."""
    out_features, in_features = w.shape
    halves = w.detach().double().view(out_features, in_features // HALF, HALF)
    scale, k, found = finest_grid(halves, halves.abs().amax(-1), K_MAX)  # an all-zero half: S = 0, k = 0
    if not found.all():
        return None
    if not torch.equal(k * scale[..., None], halves):  # S·k gives every weight exactly
        return None
    groups = in_features // GROUP
    return scale.float().view(out_features, groups, 2).contiguous(), k.to(torch.int8).view(out_features, groups, GROUP)
