"""Fixed-point probability masses: softmax normalizers as exact integer sums.

A float sum depends on the order of its terms, so a logsumexp taken over a gathered row and one
combined from per-shard pieces differ in the last bits, and a decision taken from them could
differ too. Here each token's weight is an integer,

    m(x) = round(exp(x − M) · 2^38),   M = the row's maximum (exact under any sharding),

and the normalizer ``Z = Σ m(x)`` is an int64 sum: the same integer for every shard layout and
summation order. Every sampling *decision* that needs a normalized probability (top-p's nucleus,
p(d) and q(d) in the acceptance test, the residual max(p − q, 0), the draft distribution q) takes
it from here, so the gathered and the vocab-parallel paths decide bit for bit alike at every TP
size. (Elementwise ``exp`` is layout-independent on one device type, as ``gumbel.gumbel`` assumes.)

Precision: m(x) is exp(x − M) to within 2^-39 (weights below that count as 0), so ``Z / 2^38`` is
the softmax normalizer to within n · 2^-39 relative for n tokens (2.4e-7 at 2^17 tokens, float32
rounding's order; Z ≥ 2^38 since the maximum weighs exactly 2^38). Headroom: Z ≤ n · 2^38 < 2^63
for any vocabulary below 2^24 (the vocab-parallel paths' limit anyway).
"""

from __future__ import annotations

import torch

MASS_BITS = 38
_ONE = 2.0**MASS_BITS


def masses(
    logits: torch.Tensor,  # [rows, n] float32, -inf = masked
    row_max: torch.Tensor,  # [rows] float32, the maximum of each whole row
) -> torch.Tensor:
    """m(x) = round(exp(x − M) · 2^38), int64 ``[rows, n]`` (masked entries weigh 0)."""
    return torch.exp(logits - row_max.unsqueeze(-1)).mul_(_ONE).round_().to(torch.int64)


def probs(
    logits: torch.Tensor,  # [rows, n] float32
    row_max: torch.Tensor,  # [rows] float32
    total: torch.Tensor,  # [rows] int64, Z = Σ masses over the whole row
) -> torch.Tensor:
    """p(x) = exp(x − M) · (2^38 / Z), float32 ``[rows, n]``."""
    scale = (_ONE / total.double()).float()  # [rows]
    return torch.exp(logits - row_max.unsqueeze(-1)).mul_(scale.unsqueeze(-1))


def reached(
    cum: torch.Tensor,  # [rows, n] int64, cumulative masses
    top_p: torch.Tensor,  # [rows] float32
    total: torch.Tensor,  # [rows] int64
) -> torch.Tensor:
    """cum ≥ top_p · Z, bool ``[rows, n]`` (float64 arithmetic on exact integers: deterministic)."""
    return cum.double() >= (top_p.double() * total.double()).unsqueeze(-1)
