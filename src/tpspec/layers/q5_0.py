"""Q5_0 weights (most of Gemma 3 270M's layers in its Q4_K_M GGUF): llama.cpp's format, 32 weights a
group, w = d·(q − 16) with q a 5-bit integer and d float16 (d = max / −16, ``max`` the group's value
of largest magnitude). ``exact_groups`` recovers such groups from the float32 weights the loader
gives (None where a weight is not exactly Q5_0, or Q8_0 in some groups: nothing is re-quantized);
as whole numbers in −16..16 times |d| they are Q8_0 groups with another d than Q8_0's own rounding
picks, so the Q8_0 kernels take them (``int8_dot.quantize_exact_q5_0``; ``quantize_exact`` for
``q8_0_linear``): 1.06 bytes a weight against float16's 2.
"""

from __future__ import annotations

import torch

from tpspec.layers import q8_0
from tpspec.layers.row_chunks import by_row_chunks

GROUP = 32  # weights per group (one d)
LEVELS = 16  # q − 16 runs over −16..15


@by_row_chunks
def exact_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` ([out, in] float32) as whole-number groups if every group is exactly Q5_0 (d·k with a
    float16 d ≥ 0 and k in −16..16: d = max |w| / 16, |llama.cpp's d|, its value of largest magnitude
    k = ±16) or exactly Q8_0 (``q8_0.exact_groups``' rule, d = max |w| / 127): a merged weight
    (Gemma 3's q/k/v, where v is Q8_0 in half the layers) mixes the two. d [out, groups] float16 and
    k [out, groups, 32] int8; else None."""
    out_features, in_features = w.shape
    groups = w.detach().view(out_features, in_features // GROUP, GROUP)
    q5, q8 = q8_0.group_multiples(groups, LEVELS), q8_0.group_multiples(groups, q8_0.Q_MAX)  # Q5_0's d, Q8_0's
    if q5 is None or q8 is None:
        return None
    (d5, k5, exact5), (d8, k8, exact8) = q5, q8
    if not (exact5 | exact8).all():
        return None
    d = torch.where(exact5, d5, d8)
    k = torch.where(exact5[..., None], k5, k8)
    return d.contiguous(), k.to(torch.int8)


def quantize_exact(w: torch.Tensor) -> q8_0.Q8_0Weight | None:
    """``w`` ([out, in] float32) in the Q8_0 kernel's layout (``q8_0_linear``) if its groups are
    exactly Q5_0 or Q8_0 (``exact_groups``), else None."""
    return q8_0.laid_out(exact_groups(w))
