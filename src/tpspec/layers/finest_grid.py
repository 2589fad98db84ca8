"""The finest grid of whole-number steps that holds a group of weights exactly: how Q4_K's and
Q6_K's groups (``layers.q4_k``, ``layers.q6_k``), whose steps are a float16 times a small integer
(float32 values, not float16 ones), are recovered from the float32 weights the loader gives."""

from __future__ import annotations

import torch


def finest_grid(values: torch.Tensor, extent: torch.Tensor, max_levels: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [..., n] float64 (a group's weights, or their distances from its least), extent [...]
    their largest magnitude. Per group, the step extent / levels for the most levels ≤ max_levels
    that is a float32 value and gives every value as a whole multiple k with |k| ≤ max_levels,
    exactly in float64: step [...], k [..., n] (float64) and [...] whether one was found (a group of
    zeros: step 0, k 0)."""
    step = torch.zeros_like(extent)
    k = torch.zeros_like(values)
    found = extent == 0
    for levels in range(max_levels, 0, -1):
        step32 = (extent / levels).float().double()  # the step must be a float32 value
        kn = torch.round(values / torch.where(step32 == 0, torch.ones_like(step32), step32)[..., None])
        fits = ~found & (step32 > 0) & (kn.abs() <= max_levels).all(-1) & (kn * step32[..., None] == values).all(-1)
        step = torch.where(fits, step32, step)
        k = torch.where(fits[..., None], kn, k)
        found |= fits
        if found.all():
            break
    return step, k, found
