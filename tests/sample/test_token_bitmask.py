"""Token bitmasks: the bit layout, and masking the gathered logits, a vocab shard, and a shard
whose columns stand for other ids (EAGLE-3's draft vocabulary) all forbid the same tokens."""

from __future__ import annotations

import torch

from tpspec.sample import token_bitmask
from tpspec.sample.token_bitmask import allowed, constrained_rows, words_for
from tpspec.sample.vocab_parallel import LogitsShard

VOCAB = 100


def _bitmask(rows: list[set[int] | None]) -> torch.Tensor:
    """Rows allowing exactly the given ids (None: every id)."""
    out = torch.full((len(rows), words_for(VOCAB)), -1, dtype=torch.int32)
    for r, ids in enumerate(rows):
        if ids is not None:
            words = [0] * words_for(VOCAB)
            for t in ids:
                words[t // 32] |= 1 << (t % 32)
            out[r] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    return out


ROWS = [{0, 31, 32, 63, 64, 99}, None, {5}]


def test_layout_and_constrained_rows():
    bm = _bitmask(ROWS)
    ok = allowed(bm, torch.arange(-1, VOCAB + 40))  # ids outside the bitmask's words are never allowed
    for r, ids in enumerate(ROWS):
        expect = set(range(32 * words_for(VOCAB))) if ids is None else ids
        assert {i - 1 for i in torch.nonzero(ok[r]).squeeze(-1).tolist()} == expect
    assert constrained_rows(bm).tolist() == [0, 2]


def test_the_gathered_row_and_every_shard_forbid_the_same_tokens():
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB)
    bm = _bitmask(ROWS)
    full = logits.clone()
    token_bitmask.apply(full, bm)
    for r, ids in enumerate(ROWS):
        kept = torch.isfinite(full[r]).nonzero().squeeze(-1).tolist()
        assert kept == (list(range(VOCAB)) if ids is None else sorted(ids))
        assert torch.equal(full[r][kept], logits[r][kept])  # allowed logits untouched
    for start, size in ((0, 40), (40, 40), (80, 40)):  # the last shard runs past the vocabulary (padding)
        cols = torch.full((len(ROWS), size), float("-inf"))
        real = min(size, VOCAB - start)
        cols[:, :real] = logits[:, start : start + real]
        shard = LogitsShard(cols, start, VOCAB)
        token_bitmask.apply(shard, bm)
        assert torch.equal(shard.logits[:, :real], full[:, start : start + real])


def test_columns_standing_for_other_ids():
    """EAGLE-3: draft column i is target id target_ids[i]; the mask is over target ids."""
    target_ids = torch.tensor([0, 5, 31, 32, 70, 99])
    logits = torch.zeros(len(ROWS), len(target_ids))
    token_bitmask.apply(logits, _bitmask(ROWS), target_ids)
    assert torch.isfinite(logits).tolist() == [
        [True, False, True, True, False, True], [True] * 6, [False, True, False, False, False, False],
    ]
    assert token_bitmask.apply(logits, None) is None  # no grammar: nothing to do


def test_unpacked_columns_equal_the_gathered_bits():
    torch.manual_seed(1)
    bm = torch.randint(-(2**31), 2**31 - 1, (3, words_for(VOCAB)), dtype=torch.int32)
    for start, width in ((0, VOCAB), (7, 50), (33, 80), (120, 20)):  # the last runs past the bitmask
        assert torch.equal(token_bitmask.allowed_columns(bm, start, width), allowed(bm, torch.arange(start, start + width)))


def test_rows_read_only_through_their_argmax_are_masked_only_when_it_is_forbidden():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [0.0, 1.0, 2.0, 3.0], [3.0, 1.0, 0.0, 0.0]]).repeat_interleave(25, 1)[:, :VOCAB]
    rows = [set(range(25, 50)), set(range(0, 25)), set(range(50, 100))]  # row 0: argmax 25 allowed
    bm = _bitmask(rows)
    full = logits.clone()
    token_bitmask.apply(full, bm)
    lazy = logits.clone()
    token_bitmask.apply(lazy, bm, argmax_only=torch.tensor([True, True, False]))
    assert torch.equal(lazy[0], logits[0])  # left as it was: its argmax is allowed
    assert torch.equal(lazy[1:], full[1:])  # argmax forbidden, or not argmax-only: masked
    assert torch.equal(lazy.argmax(-1), full.argmax(-1))
    # Columns standing for other ids (EAGLE-3): the argmax column's id is what is checked.
    ids = torch.tensor([50, 10, 60, 70])
    cols = torch.tensor([[4.0, 1.0, 0.0, 0.0], [4.0, 1.0, 0.0, 0.0]])
    lazy = cols.clone()
    token_bitmask.apply(lazy, _bitmask([{50, 10}, {10}]), ids, argmax_only=torch.tensor([True, True]))
    assert torch.equal(lazy[0], cols[0]) and lazy[1].tolist() == [float("-inf"), 1.0, float("-inf"), float("-inf")]
