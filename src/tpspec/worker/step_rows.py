"""A step's row maps, built once with NumPy from the scheduled sequences: the token rows of the
target forward (ids, positions), and the rows it samples (each sampling sequence's verified
draft positions and its bonus position), with the request slot and position of each."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpspec.worker.request_state import ScheduledSeq


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``range(s, s + c)`` for each (s, c): [counts.sum()] int64."""
    return np.repeat(starts, counts) + _offsets(counts)


def _offsets(counts: np.ndarray) -> np.ndarray:
    """0 … c − 1 for each c, concatenated: [counts.sum()] int64."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass(frozen=True)
class StepRows:
    num_tokens: np.ndarray  # [seqs] tokens fed (real ones, then the drafts being verified)
    start_pos: np.ndarray  # [seqs] position of each sequence's first fed token
    num_spec: np.ndarray  # [seqs] drafts being verified
    sampling: np.ndarray  # [sampling seqs] index of each sequence that samples this step
    hidden_rows: np.ndarray  # [rows] the forward's row of each sampled row
    positions: np.ndarray  # [rows] position of the token each sampled row draws
    slots: np.ndarray  # [rows] the request's sampling-state slot
    last_row: np.ndarray  # [seqs] the sampled row of each sequence's bonus position (-1: none)

    @property
    def num_rows(self) -> int:
        return self.hidden_rows.shape[0]

    def token_positions(self) -> np.ndarray:
        """[num_tokens] the position of every fed token, sequence by sequence."""
        return _ranges(self.start_pos, self.num_tokens)

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq], slot_of: Mapping[str, int]) -> "StepRows":
        n = len(seqs)
        per_seq = np.array([(len(s.token_ids), s.start_pos, s.num_spec, s.sample, slot_of[s.req_id]) for s in seqs],
                           dtype=np.int64).reshape(n, 5)  # [seqs, 5]
        num_tokens, start_pos, num_spec, sample, slot = per_seq.T
        sampling = np.flatnonzero(sample)
        if sampling.shape[0] == n and not num_spec.any():  # decodes and last chunks only: a row each
            hidden_rows = np.cumsum(num_tokens) - 1
            positions = start_pos + num_tokens
            slots = slot.copy()
            last_row = np.arange(n, dtype=np.int64)
        else:  # per sampling sequence: each draft position and the bonus position
            counts = num_spec[sampling] + 1
            ends = np.cumsum(num_tokens)[sampling]
            offsets = _offsets(counts)
            hidden_rows = np.repeat(ends - counts, counts) + offsets
            positions = np.repeat(start_pos[sampling] + num_tokens[sampling] - counts + 1, counts) + offsets
            slots = np.repeat(slot[sampling], counts)
            last_row = np.full(n, -1, dtype=np.int64)
            last_row[sampling] = np.cumsum(counts) - 1
        return cls(num_tokens, start_pos, num_spec, sampling, hidden_rows, positions, slots, last_row)
