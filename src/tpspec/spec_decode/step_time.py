"""How long an engine step takes, as a function of its rows: the speculation-length controller's cost.

    step(k) = target(target rows) + feed(feed rows) + Σ_passes draft(pass rows) + overhead

* ``target(r)``: the target's forward, LM head and verification over r rows (every fed token, the
  drafts being verified included); a step in which every request feeds exactly one token and
  verifies nothing runs ``decode(r)`` instead: its attention takes the one-query path, which a
  single draft anywhere in the step gives up (on CPU a jump that the controller must see);
* ``feed(r)``: the drafter's work that does not depend on k, for r kept tokens (DFlash writes their
  context K/V, EAGLE-3 refeeds them, a draft model runs them); DFlash defers it while no request
  proposes (``DEFERRED_FEED_METHODS``), so such a step has no feed;
* ``draft(r)``: one drafting pass over r rows (forward, LM head and draft sampling). Which passes
  a choice of k per request makes depends on the method (``draft_passes``);
* ``overhead``: the rest of a step (host work, scheduling, RPC), a running mean.

Each curve is piecewise linear on a grid of row counts, measured by a short profile at start-up
(``ModelRunner.profile_step_time``, over sequences with ``PROFILE_CONTEXT`` earlier tokens) and
corrected online from every step's measured phase times by normalized least mean squares: the
error of a step's prediction is spread over the grid points the prediction used, in proportion
to their weight in it.
"""

from __future__ import annotations

import numpy as np

# Profiled sequences attend to this many earlier tokens (attention's share of a step grows with
# the context: a profile over empty contexts would underrate verifying drafts).
PROFILE_CONTEXT = 256
# Drafters that feed only the requests proposing drafts (the others' kept tokens wait until they do).
DEFERRED_FEED_METHODS = ("dflash",)
LEARNING_RATE = 0.3  # fraction of a step's prediction error corrected at once
OVERHEAD_DECAY = 0.9


def profile_context(max_model_len: int, num_slots: int, query_len: int) -> int:
    """Earlier tokens each profiled sequence attends to: ``PROFILE_CONTEXT``, less where
    max_model_len or the KV cache leaves less room."""
    return max(0, min(PROFILE_CONTEXT, max_model_len - query_len, num_slots - query_len))


def profile_grid(max_rows: int) -> list[int]:
    """Row counts to profile: powers of two up to ``max_rows``, and ``max_rows`` itself."""
    grid = [1]
    while grid[-1] * 2 < max_rows:
        grid.append(grid[-1] * 2)
    if grid[-1] < max_rows:
        grid.append(max_rows)
    return grid


def draft_passes(method: str, ks: list[int]) -> list[int]:
    """Rows of each drafting pass when the requests of a step propose ``ks`` drafts each.
    DFlash runs one block of k + 1 rows per proposing request; chain drafters (EAGLE-3, a draft
    model) run pass j over the requests that want at least j drafts; n-gram lookup runs none."""
    if method == "ngram":
        return []
    if method == "dflash":
        rows = sum(k + 1 for k in ks if k > 0)
        return [rows] if rows else []
    return [sum(1 for k in ks if k >= j) for j in range(1, max(ks, default=0) + 1)]


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
        self, method: str, decode: PiecewiseLinear, target: PiecewiseLinear, feed: PiecewiseLinear, draft: PiecewiseLinear
    ):
        self.method = method
        self.decode, self.target, self.feed, self.draft = decode, target, feed, draft
        self.overhead = 0.0  # seconds per step

    def forward_curve(self, decode_only: bool) -> PiecewiseLinear:
        return self.decode if decode_only else self.target

    def fed_rows(self, feed_rows: int, proposing: bool) -> int:
        """Rows the drafter feeds in a step with ``feed_rows`` kept tokens (approximately, for a
        deferring drafter: the backlog of the requests that propose is not known here)."""
        return 0 if not proposing and self.method in DEFERRED_FEED_METHODS else feed_rows

    def predict(self, target_rows: int, feed_rows: int, ks: list[int], decode_only: bool = False) -> float:
        """Seconds of a step: the target's forward, the drafter's feed and passes, the overhead."""
        fed = self.fed_rows(feed_rows, any(k > 0 for k in ks))
        drafter = self.feed(fed) + sum(self.draft(r) for r in draft_passes(self.method, ks))
        return self.forward_curve(decode_only)(target_rows) + drafter + self.overhead

    def observe(
        self, target_rows: int, feed_rows: int, ks: list[int], target_s: float, drafter_s: float, step_s: float,
        decode_only: bool = False,
    ) -> None:
        """Correct the curves with one step's measured phase times (and its wall time)."""
        _nlms(self.forward_curve(decode_only), [target_rows], target_s)
        if self.method != "ngram":
            passes = draft_passes(self.method, ks)
            fed = self.fed_rows(feed_rows, any(k > 0 for k in ks))
            _nlms_joint([(self.feed, [fed] if fed else []), (self.draft, passes)], drafter_s)
        rest = max(0.0, step_s - target_s - drafter_s)
        self.overhead = OVERHEAD_DECAY * self.overhead + (1.0 - OVERHEAD_DECAY) * rest

    def as_dict(self) -> dict:
        return {
            "grid": self.target.xs.astype(int).tolist(),
            "decode_s": self.decode.values(),
            "target_s": self.target.values(),
            "feed_s": self.feed.values(),
            "draft_pass_s": self.draft.values(),
            "overhead_s": self.overhead,
        }


def _nlms(curve: PiecewiseLinear, xs: list[int], observed: float) -> None:
    _nlms_joint([(curve, xs)], observed)


def _nlms_joint(terms: list[tuple[PiecewiseLinear, list[int]]], observed: float) -> None:
    """Normalized LMS on the sum Σ_curves Σ_x curve(x) against one observed total."""
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
    step = LEARNING_RATE * (observed - predicted) / norm
    for curve, w in weights:
        for i, b in w.items():
            curve.ys[i] = max(curve.ys[i] + step * b, 0.0)
        curve.ys[:] = np.maximum.accumulate(curve.ys)
