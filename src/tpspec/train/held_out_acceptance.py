"""Held-out acceptance as greedy speculation meets it.

A trainer scores a drafter at every origin of a held-out continuation (an origin: the position
just before the newest verified token, from which k drafts are proposed). Greedy speculation does
not visit every origin: after a step that accepts r drafts the next origin is r + 1 positions on,
so the origins it meets follow rejections and skip the inside of well-drafted runs. Averaging
over all origins counts each easy run once per position in it and so overstates what serving
measures (the shipped EAGLE-3 head: 2.56 over all origins, 2.18 along the visited ones, where the
engine itself measured the same drafts at the same origins; benchmarks/README.md). Trainers report
both; ``acceptance_length`` is the visited one.
"""

from __future__ import annotations

import torch


class HeldOutAcceptance:
    """Accumulates per-sequence draft correctness and reports the acceptance figures."""

    def __init__(self, depth: int):
        self.all_lengths: list[int] = []
        self.visited_lengths: list[int] = []
        self.accepted = torch.zeros(depth)  # [depth] visited origins whose drafts 1 … j + 1 were all accepted

    def add(self, ok: torch.Tensor) -> None:
        """ok: [origins, depth] bool, draft j at origin o equal to the target's token; the origins
        of one sequence, consecutive positions in order."""
        leading = ok.long().cumprod(dim=1)  # [origins, depth] 1 while every draft so far is accepted
        lengths = (1 + leading.sum(dim=1)).tolist()
        self.all_lengths += lengths
        o = 0
        while o < len(lengths):  # greedy speculation: the next origin follows the accepted drafts and the bonus token
            self.visited_lengths.append(lengths[o])
            self.accepted += leading[o].float()
            o += lengths[o]

    def result(self) -> dict:
        visited = max(1, len(self.visited_lengths))
        return {
            "acceptance_length": sum(self.visited_lengths) / visited,
            "position_acceptance": (self.accepted / visited).tolist(),  # share of visited origins accepting draft j
            "acceptance_length_all_origins": sum(self.all_lengths) / max(1, len(self.all_lengths)),
            "anchors": len(self.all_lengths),
            "visited": len(self.visited_lengths),
        }
