"""The frame of every GGUF format's exact recovery (``exact_groups`` of ``q4_1``, ``q8_0``, ``q5_0``,
``q4_k``, ``q6_k``): the checks they share (a 2-D float32 weight of whole 32-weight groups; its first
row alone first, which refuses most weights of another format at once), then the recovery a chunk of
rows at a time. A format's ``exact_groups`` makes several whole-tensor passes (magnitudes, steps,
rounding, the check); over Gemma 3's 262,144 x 640 token embedding (its LM head) each pass allocates
and streams a 670 MB float32 temporary, and the Q8_0 recovery took 1.3 s, against 0.3 s in chunks
of 2,048 rows, whose 5 MB temporaries stay in the last-level cache (an AMD EPYC Zen 5; Q4_K's and
Q6_K's work in float64, twice that). A format's groups lie within a row, so the chunks' groups are
the weight's."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

CHUNK_ROWS = 2048
GROUP = 32  # weights per group in every format's layout (Q6_K's 16-weight halves pair up)

Groups = tuple[torch.Tensor, ...]


def by_row_chunks(exact_groups: Callable[[torch.Tensor], Groups | None]) -> Callable[[torch.Tensor], Groups | None]:
    """``exact_groups`` (a 2-D float32 weight [out, in] of whole groups -> tensors whose first
    dimension is ``out``, or None where the weight is not of its format) behind the shared checks,
    run on ``CHUNK_ROWS`` rows at a time, the chunks' tensors concatenated; None where a check or
    a chunk fails."""

    @functools.wraps(exact_groups)
    def chunked(w: torch.Tensor) -> Groups | None:
        if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % GROUP:
            return None
        if w.shape[0] > 1 and exact_groups(w[:1]) is None:  # one row refuses most other weights at once
            return None
        if w.shape[0] <= CHUNK_ROWS:
            return exact_groups(w)
        parts = []
        for rows in w.split(CHUNK_ROWS):
            part = exact_groups(rows)
            if part is None:
                return None
            parts.append(part)
        return tuple(torch.cat(tensors) for tensors in zip(*parts))

    return chunked
