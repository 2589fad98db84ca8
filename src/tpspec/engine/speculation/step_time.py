"""How long an engine step takes, by its rows and sequences: the speculation-length controller's cost.

    step = forward(rows, seqs) + feed(feed rows) + Σ_passes draft(pass rows) + overhead
    forward(rows, seqs) = rows(rows) + seqs(seqs) + verify_jump · [the step verifies drafts]

* ``rows(r)``: the target's forward, LM head and verification over r rows (every fed token, the
  drafts being verified included), as measured on sequences of k + 1 tokens: the weights' share
  of a step, which grows with every verified draft;
* ``seqs(s)``: what s sequences add beyond that, reading their contexts in attention (the
  profile's decodes of s sequences less ``rows(s)``). A step's sequences do not depend on k, but
  leaving this term out, or folding it into a curve of rows, charges a step of decodes for
  attention that a step with drafts seems not to pay (and so over-speculates);
* ``verify_jump``: what a step of decodes alone saves (one query per sequence, no verification),
  which a single draft anywhere in the step gives up; learned online;
* ``feed(r)``: the drafter's work that does not depend on k, for r kept tokens (DFlash writes their
  context K/V, EAGLE-3 and MTP refeed them, a draft model runs them); DFlash and the chain heads
  defer it while no request proposes (the methods table's ``defers_feed``), so such a step has no feed;
* ``draft(r)``: one drafting pass over r rows (forward, LM head and draft sampling). Which passes
  a choice of k per request makes depends on the method (``SpeculativeMethod.draft_passes``);
* ``overhead``: the rest of a step (host work, scheduling, RPC), a running mean.

Each curve is piecewise linear on a grid of row (or sequence) counts, measured by a short profile
at start-up (``ModelRunner.profile_step_time``, over sequences with ``spec_decode.step_profile.PROFILE_CONTEXT``
earlier tokens) and corrected online from every step's measured phase times by normalized least mean
squares: the error of a step's prediction is spread over the grid points (and terms) the
prediction used, in proportion to their weight in it.
"""

from __future__ import annotations

import numpy as np

from tpspec.config.speculative_methods import SpeculativeMethod

LEARNING_RATE = 0.3  # fraction of a step's prediction error corrected at once
# A step's measured phase counts as at most this many times its prediction, and at least its
# prediction divided by it: one stall (a garbage collection, a preempted thread) then moves the
# curves no more than a step this much slower than predicted does, while a curve that is really off
# still gets there over a few more steps (7.5 % of the prediction a step at most). (Served at one
# stream, after one 135 ms drafter phase, its whole step predicted at 14 ms, the stream proposed in
# 93 of its next 1,173 steps, its first probes predicted at 25 ms and measured at 11-13.) Offline at
# one stream on a Zen 5, EAGLE-3 adaptive, 95 % of the steps' phases came within 0.88-1.15x of
# their prediction, 1 % past 1.25x, the worst 2-6x; with 2.0 one such step raised the verify
# jump, which only steps with drafts teach, from 0.03 to 0.50 ms (every drafting step predicted
# 0.5 ms dearer), where it stayed through the 75 steps held at k = 0 that followed.
MAX_ERROR_RATIO = 1.25
OVERHEAD_DECAY = 0.9


class PiecewiseLinear:
    """y(x) linear between grid points ``xs``, extended along the last segment past the last one
    (and through (0, 0) below the first)."""

    def __init__(self, xs: list[int], ys: list[float]):
        if len(xs) != len(ys) or not xs:
            raise ValueError("a curve needs as many values as grid points, at least one")
        self.xs = np.asarray(xs, dtype=np.float64)  # [points] increasing
        self.ys = np.maximum.accumulate(np.maximum(np.asarray(ys, dtype=np.float64), 0.0))  # [points]

    def basis(self, x: float) -> list[tuple[int, float]]:
        """(grid index, weight) pairs with y(x) = Σ weight · ys[index]."""
        xs = self.xs
        if x <= 0:
            return []
        if len(xs) == 1 or x <= xs[0]:
            return [(0, x / xs[0])]
        i = min(int(np.searchsorted(xs, x)) - 1, len(xs) - 2)
        t = (x - xs[i]) / (xs[i + 1] - xs[i])  # > 1 past the last point: extrapolation
        return [(i, 1.0 - t), (i + 1, t)]

    def __call__(self, x: float) -> float:
        return sum(w * self.ys[i] for i, w in self.basis(x))

    def at(self, xs: np.ndarray) -> np.ndarray:
        """``self(x)`` for every x of ``xs`` at once."""
        xs = np.asarray(xs, dtype=np.float64)
        x0, y0 = self.xs[0], self.ys[0]
        ys = np.interp(xs, self.xs, self.ys)
        ys = np.where(xs < x0, xs / x0 * y0, ys)
        if len(self.xs) > 1:
            slope = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2])
            ys = np.where(xs > self.xs[-1], self.ys[-1] + slope * (xs - self.xs[-1]), ys)
        return np.where(xs <= 0, 0.0, ys)

    def values(self) -> list[float]:
        return self.ys.tolist()


class StepTimeModel:
    def __init__(
        self, method: SpeculativeMethod, rows: PiecewiseLinear, seqs: PiecewiseLinear, feed: PiecewiseLinear, draft: PiecewiseLinear
    ):
        self.method = method
        self.rows, self.seqs, self.feed, self.draft = rows, seqs, feed, draft
        self.verify_jump = PiecewiseLinear([1], [0.0])  # one value, read at 1: learned from steps with drafts
        self.overhead = 0.0  # seconds per step

    @classmethod
    def from_profile(cls, method: SpeculativeMethod, p: dict) -> "StepTimeModel":
        """The model of a start-up profile (``ModelRunner.profile_step_time``): ``rows_s``,
        ``feed_s`` and ``draft_pass_s`` on ``rows_grid``, ``decode_s`` on ``seqs_grid``."""
        rows = PiecewiseLinear(p["rows_grid"], p["rows_s"])
        seqs = p["seqs_grid"]
        extra = [d - rows(s) for s, d in zip(seqs, p["decode_s"])]  # attention over s contexts
        return cls(method, rows, PiecewiseLinear(seqs, extra),
                   PiecewiseLinear(p["rows_grid"], p["feed_s"]), PiecewiseLinear(p["rows_grid"], p["draft_pass_s"]))

    def forward(self, rows: int, seqs: int, decode_only: bool) -> float:
        """The target's share of a step of ``rows`` rows in ``seqs`` sequences."""
        return self.rows(rows) + self.seqs(seqs) + (0.0 if decode_only else self.verify_jump(1))

    def forward_by_drafts(self, real_rows: int, seqs: int, most: int) -> np.ndarray:
        """[most + 1] ``forward`` of a step with 0 … ``most`` verified drafts beside its
        ``real_rows`` fed tokens (with 0: of decodes alone if the step is only decodes)."""
        out = self.rows.at(np.arange(real_rows, real_rows + most + 1)) + self.seqs(seqs) + self.verify_jump(1)
        if real_rows == seqs:
            out[0] -= self.verify_jump(1)
        return out

    def fed_rows(self, feed_rows: int, proposing: bool) -> int:
        """Rows the drafter feeds in a step with ``feed_rows`` kept tokens (approximately, for a
        deferring drafter: the backlog of the requests that propose is not known here)."""
        return 0 if not proposing and self.method.defers_feed else feed_rows

    def predict(self, target_rows: int, seqs: int, feed_rows: int, ks: list[int], decode_only: bool = False) -> float:
        """Seconds of a step: the target's forward, the drafter's feed and passes, the overhead."""
        fed = self.fed_rows(feed_rows, any(k > 0 for k in ks))
        drafter = self.feed(fed) + sum(self.draft(r) for r in self.method.draft_passes(ks))
        return self.forward(target_rows, seqs, decode_only) + drafter + self.overhead

    def observe(
        self, target_rows: int, seqs: int, fed_rows: int, ks: list[int], target_s: float, drafter_s: float,
        step_s: float, decode_only: bool = False,
    ) -> None:
        """Correct the curves with one step's measured phase times (and its wall time). ``fed_rows``:
        the rows the drafter fed, as it counted them: a request that proposes after a stretch
        without drafts feeds its whole backlog, which ``fed_rows(...)`` cannot know in advance
        (charged to this step's kept tokens alone, one probe's backlog taught the model a feed of
        1 row as dear as one of 60, and the controller then held speculation off at c = 1)."""
        jump = [] if decode_only else [1]
        _nlms_joint([(self.rows, [target_rows]), (self.seqs, [seqs]), (self.verify_jump, jump)], target_s)
        if not self.method.free_proposal:
            passes = self.method.draft_passes(ks)
            _nlms_joint([(self.feed, [fed_rows] if fed_rows else []), (self.draft, passes)], drafter_s)
        rest = max(0.0, step_s - target_s - drafter_s)
        self.overhead = OVERHEAD_DECAY * self.overhead + (1.0 - OVERHEAD_DECAY) * rest

    def as_dict(self) -> dict:
        return {
            "rows_grid": self.rows.xs.astype(int).tolist(),
            "rows_s": self.rows.values(),
            "seqs_grid": self.seqs.xs.astype(int).tolist(),
            "seqs_s": self.seqs.values(),
            "verify_jump_s": self.verify_jump(1),
            "feed_s": self.feed.values(),
            "draft_pass_s": self.draft.values(),
            "overhead_s": self.overhead,
        }


def _nlms_joint(terms: list[tuple[PiecewiseLinear, list[int]]], observed: float) -> None:
    """Normalized LMS on the sum Σ_curves Σ_x curve(x) against one observed total (held within
    ``MAX_ERROR_RATIO`` of the prediction)."""
    weights: list[tuple[PiecewiseLinear, dict[int, float]]] = []
    predicted, norm = 0.0, 0.0
    for curve, xs in terms:
        w: dict[int, float] = {}
        for x in xs:
            for i, b in curve.basis(x):
                w[i] = w.get(i, 0.0) + b
        predicted += sum(b * curve.ys[i] for i, b in w.items())
        norm += sum(b * b for b in w.values())
        weights.append((curve, w))
    if norm == 0.0:
        return
    if predicted > 0.0:
        observed = min(max(observed, predicted / MAX_ERROR_RATIO), predicted * MAX_ERROR_RATIO)
    step = LEARNING_RATE * (observed - predicted) / norm
    for curve, w in weights:
        if not w:
            continue
        for i, b in w.items():
            curve.ys[i] = max(curve.ys[i] + step * b, 0.0)
        # The grid points past those the step used take the last one's correction: a step slower
        # than its prediction at 32 rows makes 48 rows as much slower, and what 16 more rows cost
        # stays the profile's. (Raising the used points alone, then flattening the curve to keep it
        # increasing, taught a model served at 32 sequences that 16 verified drafts cost nothing.)
        top = max(w)
        curve.ys[top + 1 :] = np.maximum(curve.ys[top + 1 :] + step * w[top], 0.0)
        curve.ys[:] = np.maximum.accumulate(curve.ys)
