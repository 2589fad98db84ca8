"""Held-out acceptance along the origins greedy speculation visits (train/held_out_acceptance.py)."""

import pytest
import torch

from tpspec.train.held_out_acceptance import HeldOutAcceptance


def test_visited_origins_follow_accepted_drafts():
    # 6 consecutive origins, k = 2: origin 0 accepts both drafts (length 3), so the engine's next
    # origin is 3, which rejects draft 1 (length 1), then 4, which accepts draft 1 only (length 2).
    ok = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 1], [1, 0], [1, 1]], dtype=torch.bool)
    scores = HeldOutAcceptance(2)
    scores.add(ok)
    r = scores.result()
    assert r["visited"] == 3 and r["anchors"] == 6
    assert r["acceptance_length"] == pytest.approx((3 + 1 + 2) / 3)
    assert r["position_acceptance"] == pytest.approx([2 / 3, 1 / 3])  # draft 2 counts only after draft 1
    assert r["acceptance_length_all_origins"] == pytest.approx((3 + 3 + 3 + 1 + 2 + 3) / 6)


def test_sequences_are_walked_separately():
    # each sequence starts at its own first origin, whatever the previous one's last step skipped
    scores = HeldOutAcceptance(1)
    scores.add(torch.tensor([[1], [1], [1]], dtype=torch.bool))  # visits origins 0 and 2
    scores.add(torch.tensor([[0], [1]], dtype=torch.bool))  # visits 0 and 1
    r = scores.result()
    assert r["visited"] == 4
    assert r["acceptance_length"] == pytest.approx((2 + 2 + 1 + 2) / 4)


def test_empty():
    r = HeldOutAcceptance(3).result()
    assert r["visited"] == r["anchors"] == 0 and r["acceptance_length"] == 0.0
