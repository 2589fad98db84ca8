"""Per-position draft acceptance rates, measured while serving, for the speculation-length controller.

The rate at draft position j (1-based) is conditional: α_j = P(draft j accepted | drafts 1 … j − 1
accepted). A verification of k drafts that accepted a of them tried positions 1 … min(a + 1, k)
and accepted positions 1 … a. The expected number of accepted drafts when k are verified is then
Σ_{j ≤ k} Π_{m ≤ j} α_m, and the j-th term is what the j-th draft adds (``marginal_gains``).

Counts decay exponentially (old behaviour fades): engine-wide with a window of
``ENGINE_WINDOW`` verifications, per request with ``REQUEST_WINDOW``. Estimates are shrunk
toward a prior with pseudo-observations: the engine-wide rate at position j toward the
drafter's measured rate there (``speculative_config.acceptance_prior``, ``MEASURED_PRIOR_WEIGHT``
of them), past what it gives toward the engine-wide rate at j − 1 (position 1 toward ``PRIOR``),
``PRIOR_WEIGHT`` of them; a request's rate toward the engine-wide one (``REQUEST_PRIOR_WEIGHT``),
so a request with little history behaves like the average request and a short lucky streak does
not make it speculate. The drafter's own rates matter where a stream decodes fast: at one stream
on a 2-core Zen 4 the shipped EAGLE-3 head pays from its first draft on (α_1 ≈ 0.52), which
``PRIOR`` said it would not, and a request held at k = 0 learns its rate from rare probes only:
so an unlucky start must not outweigh the drafter's measurement (see ``MEASURED_PRIOR_WEIGHT``).
"""

from __future__ import annotations

import numpy as np

PRIOR = 0.4  # acceptance assumed at position 1 before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-observations behind an assumed engine-wide prior (PRIOR, or the rate one position before)
# Pseudo-observations behind the drafter's measured rate at a position. With 4, at one stream on a
# Zen 5 (where a first draft pays from α_1 ≈ 0.36 on), the shipped EAGLE-3 head's first request
# once accepted 1 of its first 5 drafts: α_1 fell from 0.50 to 0.34 and the stream was held at
# k = 0 for 6 requests, learning from a probe every 50-75 steps. Three fresh runs of the same 8
# prompts one at a time: mean k 0.05, 1.33 and 1.08 with 4, 1.92, 2.00 and 2.00 with 16.
MEASURED_PRIOR_WEIGHT = 16.0
REQUEST_PRIOR_WEIGHT = 16.0  # pseudo-observations of the engine-wide rate behind a request's own
ENGINE_WINDOW = 256  # verifications
REQUEST_WINDOW = 32


class _Counts:
    def __init__(self, max_k: int, window: int):
        self.accepted = np.zeros(max_k)  # [max_k] decayed counts, position j at index j − 1
        self.tried = np.zeros(max_k)
        self.decay = 1.0 - 1.0 / window

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted *= self.decay
        self.tried *= self.decay
        self.tried[: min(num_accepted + 1, num_drafts)] += 1.0
        self.accepted[:num_accepted] += 1.0


class AcceptanceModel:
    def __init__(self, max_k: int, prior: tuple[float, ...] | None = None):
        """``prior``: the rates assumed at positions 1, 2, … before any is measured (None: ``PRIOR``
        at position 1); past its end each position's prior is the rate at the one before."""
        self.max_k = max_k
        self.prior = prior or ()
        self.engine = _Counts(max_k, ENGINE_WINDOW)
        self.requests: dict[str, _Counts] = {}

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts of which the first ``num_accepted`` were accepted."""
        if num_drafts <= 0:
            return
        self.engine.observe(num_drafts, num_accepted)
        counts = self.requests.get(req_id)
        if counts is None:
            counts = self.requests[req_id] = _Counts(self.max_k, REQUEST_WINDOW)
        counts.observe(num_drafts, num_accepted)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def engine_rates(self) -> np.ndarray:
        """[max_k] α_j over all requests."""
        rates = np.empty(self.max_k)
        prior = PRIOR
        for j in range(self.max_k):
            measured = j < len(self.prior)
            prior = self.prior[j] if measured else prior
            weight = MEASURED_PRIOR_WEIGHT if measured else PRIOR_WEIGHT
            prior = rates[j] = (self.engine.accepted[j] + weight * prior) / (self.engine.tried[j] + weight)
        return rates

    def request_rates(self, req_id: str, engine_rates: np.ndarray | None = None) -> np.ndarray:
        """[max_k] α_j of one request, shrunk toward the engine-wide rates."""
        return self._rates_of([req_id], self.engine_rates() if engine_rates is None else engine_rates)[0]

    def marginal_gains(self, req_id: str, engine_rates: np.ndarray | None = None) -> np.ndarray:
        """[max_k] expected accepted tokens added by the j-th draft: Π_{m ≤ j} α_m (non-increasing)."""
        return np.cumprod(self.request_rates(req_id, engine_rates))

    def marginal_gains_of(self, req_ids: list[str], engine_rates: np.ndarray) -> np.ndarray:
        """``marginal_gains`` of several requests at once: [len(req_ids), max_k]."""
        return np.cumprod(self._rates_of(req_ids, engine_rates), axis=1)

    def _rates_of(self, req_ids: list[str], engine_rates: np.ndarray) -> np.ndarray:
        """[len(req_ids), max_k] α_j of each request, shrunk toward ``engine_rates``. (A request
        without counts gets the engine's rates: (0 + w·α) / (0 + w) is α exactly, w a power of 2.)"""
        none = np.zeros(self.max_k)
        counts = [self.requests.get(r) for r in req_ids]
        accepted = np.array([none if c is None else c.accepted for c in counts])  # [n, max_k]
        tried = np.array([none if c is None else c.tried for c in counts])
        return (accepted + REQUEST_PRIOR_WEIGHT * engine_rates) / (tried + REQUEST_PRIOR_WEIGHT)
