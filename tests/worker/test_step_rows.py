"""``StepRows``: the step's row maps built with NumPy equal the per-sequence loops they replace."""

from __future__ import annotations

import random

import numpy as np

from tpspec.worker.request_state import RankRequest, ScheduledSeq
from tpspec.worker.step import SeqStep
from tpspec.worker.step_rows import StepRows
from tpspec.sampling_params import SamplingParams


def _seq(i: int, start: int, tokens: int, num_spec: int, sample: bool) -> ScheduledSeq:
    step = SeqStep(f"r{i}", start, tokens - num_spec, [], num_spec=num_spec)
    req = RankRequest(f"r{i}", [1] * (start + tokens), SamplingParams(), 0, 16, frozenset())
    return ScheduledSeq(step, req, list(range(tokens)), sample)


def test_row_maps_equal_the_loops():
    rng = random.Random(0)
    for case in range(60):
        seqs = []
        plain = case % 3 == 0  # decodes and last prefill chunks only (no drafts): a row each
        for i in range(rng.randint(1, 8)):
            num_spec = 0 if plain else rng.randint(0, 4)
            sample = plain or num_spec > 0 or rng.random() < 0.7  # drafts are only verified by a sampling sequence
            seqs.append(_seq(i, rng.randint(0, 50), num_spec + rng.randint(1, 6), num_spec, sample))
        slot_of = {s.req_id: rng.randint(0, 99) for s in seqs}
        rows = StepRows.of(seqs, slot_of)
        # The loops of the model runner before StepRows.
        ends = np.cumsum([len(s.token_ids) for s in seqs]).tolist()
        sampling = [i for i, s in enumerate(seqs) if s.sample]
        hidden_rows = [r for i in sampling for r in range(ends[i] - 1 - seqs[i].num_spec, ends[i])]
        positions = [seqs[i].start_pos + len(seqs[i].token_ids) - seqs[i].num_spec + j
                     for i in sampling for j in range(seqs[i].num_spec + 1)]
        slots = [slot_of[seqs[i].req_id] for i in sampling for _ in range(seqs[i].num_spec + 1)]
        token_positions = [p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        assert rows.sampling.tolist() == sampling
        assert rows.hidden_rows.tolist() == hidden_rows
        assert rows.positions.tolist() == positions
        assert rows.slots.tolist() == slots
        assert rows.token_positions().tolist() == token_positions
        for i in range(len(seqs)):  # each sampling sequence's bonus row is its last sampled row
            last = rows.last_row[i]
            assert (last == -1) == (i not in sampling)
            if last >= 0:
                assert hidden_rows[last] == ends[i] - 1
