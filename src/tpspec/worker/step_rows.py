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
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


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
        num_tokens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        start_pos = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        num_spec = np.fromiter((s.num_spec for s in seqs), np.int64, n)
        sampling = np.flatnonzero(np.fromiter((s.sample for s in seqs), bool, n))
        counts = num_spec[sampling] + 1  # per sampling sequence: each draft position and the bonus position
        ends = np.cumsum(num_tokens)[sampling]
        hidden_rows = _ranges(ends - counts, counts)
        positions = _ranges(start_pos[sampling] + num_tokens[sampling] - counts + 1, counts)
        slots = np.repeat(np.fromiter((slot_of[seqs[i].req_id] for i in sampling), np.int64, len(sampling)), counts)
        last_row = np.full(n, -1, dtype=np.int64)
        last_row[sampling] = np.cumsum(counts) - 1
        return cls(num_tokens, start_pos, num_spec, sampling, hidden_rows, positions, slots, last_row)
