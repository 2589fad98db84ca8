"""What drafting made, measured: tokens per second of the steps with drafts against the steps
without, per batch size, for the speculation-length controller.

The controller chooses drafts where its step-time model predicts they pay (by ``MIN_SPEEDUP``).
Near break-even that model's error decides, and on a noisy CPU a wrong guess lengthens every
sequence's step (at 8 and 32 requests on a Zen 4 the chosen drafts paid less than predicted).
So the steps themselves are compared too: per batch size, the last ``WINDOW`` steps of decodes
with drafts (some request verifies or proposes one) and the last ``WINDOW`` without, each
kind's tokens over its seconds. Once both kinds have ``MIN_STEPS`` steps and the steps with
drafts made fewer tokens per second, that batch size drafts nothing for ``HOLD_STEPS`` steps
(probes aside: they keep the acceptance rates measured, and their steps count for neither
kind); then its drafting steps are forgotten and measured anew.

Only steps of decodes alone count (every request emits a token, none has prefill rows): a
prefill chunk makes a step long whatever its drafts.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # steps of each kind per batch size whose tokens and seconds are compared
MIN_STEPS = 8  # steps of each kind before the comparison counts
HOLD_STEPS = 256  # steps a batch size drafts nothing for once its drafting steps measured slower


class RealizedRates:
    def __init__(self) -> None:
        # (batch size, drafted) -> (tokens, seconds) of its last WINDOW steps
        self._steps: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        self._held_until: dict[int, int] = {}  # batch size -> step number its hold ends at
        self._num_steps = 0
        self.num_holds = 0

    def observe(self, seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of decodes alone of ``seqs`` sequences, with drafts or without: the tokens it
        emitted and its wall time."""
        window = self._steps.setdefault((seqs, drafted), deque(maxlen=WINDOW))
        window.append((tokens, seconds))

    def tick(self) -> None:
        """One more step planned (holds count steps)."""
        self._num_steps += 1

    def rate(self, seqs: int, drafted: bool) -> float | None:
        """Tokens per second of the kept steps of that kind (None: fewer than MIN_STEPS)."""
        window = self._steps.get((seqs, drafted))
        if window is None or len(window) < MIN_STEPS:
            return None
        return sum(t for t, _ in window) / max(sum(s for _, s in window), 1e-9)

    def allows_drafts(self, seqs: int) -> bool:
        """False while steps of ``seqs`` sequences with drafts are held off; starts a hold where
        they measured fewer tokens per second than steps without."""
        held_until = self._held_until.get(seqs)
        if held_until is not None:
            if self._num_steps < held_until:
                return False
            del self._held_until[seqs]
            self._steps.pop((seqs, True), None)  # measured anew
        with_drafts, without = self.rate(seqs, True), self.rate(seqs, False)
        if with_drafts is not None and without is not None and with_drafts < without:
            self._held_until[seqs] = self._num_steps + HOLD_STEPS
            self.num_holds += 1
            return False
        return True
