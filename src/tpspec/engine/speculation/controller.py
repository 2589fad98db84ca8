"""The speculation-length controller: how many drafts each request verifies and proposes per step.

Adaptive (the default), each step it maximizes expected emitted tokens per second of step time,

    (Σ_i 1 + E[accepted_i(k_i)]) / step(k_1 … k_B),

with E[accepted_i] from the per-position acceptance rates measured while serving
(``acceptance.AcceptanceModel``) and the step time from the measured cost curves
(``step_time.StepTimeModel``), in the steady state where the k drafts proposed now are the k
verified next step. Draft j of request i adds Π_{m ≤ j} α_im tokens, which falls with j, so for a
given total of D drafts the best split gives them out one at a time to the largest next gain;
the controller scans D = 0, 1, … that way and keeps the D with the most tokens per second
(D = 0, no speculation, when no draft pays, or when the best pays less than ``MIN_SPEEDUP``:
near break-even the step-time model's error would decide). A step with prefill rows is long whatever k is,
so against its own tokens per second every draft would look cheap: there it keeps the D that
maximizes tokens − λ · seconds, λ the most tokens per second the same sequences make decoding.
A plan is kept while the step's requests stay the same (their held drafts and limits included),
so that planning is not paid every step: one that gives no request a draft for up to
``HOLD_STEPS`` steps or until a verification comes in (a probe's), one that gives drafts for up to
``DRAFTING_HOLD_STEPS`` steps (its requests' rates move little in that many verifications).
A request held at k = 0 by a drafter that defers its feed (the methods table's ``defers_feed``)
has a backlog (``PlanRequest.lag``) that it feeds in the step in which it proposes again: a step
that resumes it is charged that feed spread over ``RESUME_STEPS`` (the drafting it resumes is
expected to last about that long), and a probe is charged all of it.
So that the rates of requests held at k = 0 keep being measured, every ``PROBE_INTERVAL``-th
step requests that have drafted nothing for that long propose one draft each (a probe): all
probes share one step, and so one drafting pass, the longest idle first, as many as the probe
credit pays for. Every step earns ``PROBE_BUDGET`` of its predicted time as credit, which
carries over up to an interval's earnings and one probe's cost, so probes cost about
``PROBE_BUDGET`` of the engine's time: where one probe costs more than an interval earns (a
drafting pass beside a single fast decode), probe steps come less often than every interval.

n-gram drafts cost no drafter work (the methods table's ``free_proposal``), so there is no steady state to
plan for: adaptive, every request proposes all the drafts it may, and each step the controller
chooses how many of the drafts each request holds to verify (a lookup that found nothing takes
no share of the step's rows; a probe verifies one held draft).

With ``adaptive: false`` every request proposes ``num_speculative_tokens``; with
``num_speculative_tokens_per_batch_size`` the schedule's k for the step's batch size.
Either way a request verifies at most the drafts the ranks hold for it and what its token
budget, ``max_tokens`` and ``max_model_len`` leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpspec.config import SpeculativeConfig
from tpspec.engine.speculation.acceptance import AcceptanceModel
from tpspec.config.speculative_methods import BLOCK, LOOKUP, SpeculativeMethod
from tpspec.engine.speculation.step_time import StepTimeModel

PROBE_INTERVAL = 16  # steps between probe steps, and without drafts before a request is probed
PROBE_BUDGET = 0.01  # the probes' share of the engine's time, by the step-time model
MIN_GAIN = 1e-4  # drafts expected to add fewer tokens than this are not considered
# Drafts are chosen only where the step-time model predicts at least this many times the tokens
# per second of none: near break-even its error (several % on a noisy CPU) decides instead, and a
# wrong guess makes every sequence's step longer (EAGLE-3 at 32 sequences on a Zen 4: 1 draft for a
# third of the sequences, each step 1.11x plain's, 0.94x plain's throughput).
MIN_SPEEDUP = 1.05
# Steps a resumed request is expected to draft for: its backlog feed's share per step. (At 8
# requests on a Zen 4, EAGLE-3 bursts resumed at a sixteenth lasted 2-5 steps and lost: 0.91x plain.)
RESUME_STEPS = 4
# A plan that gave no request a draft is kept while the step's requests stay as they were and no
# verification has been observed, for up to this many steps, then made again: re-planning each
# step cost a held batch about 0.4 ms (of a 22 ms step at 8 requests on a Zen 4, as much as the
# rest of its k = 0 path), and a request held at k = 0 must cost what plain decoding costs. A
# probe's verification (every PROBE_INTERVAL steps) ends a hold anyway: with 4, a held batch of 8
# on a Zen 5 still re-planned in a third of its steps (0.27 ms a plan, cold after the forward:
# 0.09 ms a step of 7.7), with 16 in a sixth (0.04 ms).
HOLD_STEPS = 16
# A plan that gives drafts is kept for up to this many steps while the step's requests stay as they
# were: planning cost 0.18 ms a step at one stream on a Zen 5 (EAGLE-3 adaptive, in the engine,
# after the forward has cooled the caches), 3 % of a 5.5 ms step that fixed k does not pay.
DRAFTING_HOLD_STEPS = 4


@dataclass
class PlanRequest:
    """One scheduled request as the controller sees it."""

    req_id: str
    samples: bool  # the step emits a token for it (a decode, or a prefill's last chunk)
    num_held: int  # drafts the ranks hold for it, verifiable this step
    max_verify: int  # most drafts it may verify this step (token budget, max_tokens, max_model_len)
    max_propose: int  # most drafts worth proposing for its next step (max_tokens, max_model_len)
    lag: int = 0  # tokens its drafter put off (``defers_feed``): fed in the step in which it next proposes


@dataclass
class Plan:
    num_verify: list[int]  # per request: drafts verified this step
    num_propose: list[int]  # per request: drafts proposed for the next step (0: the drafter is only fed)
    target_rows: int  # rows of the target's forward
    decode_only: bool  # every request feeds one token and verifies none (step_time: no verify jump)
    predicted_s: float | None  # the step-time model's prediction (adaptive only)


class SpeculationLengthController:
    def __init__(self, spec: SpeculativeConfig, step_time: StepTimeModel | None):
        if spec.adaptive and step_time is None:
            raise ValueError("an adaptive speculation length needs a step-time model")
        self.spec = spec
        self.method = spec.method_spec
        self.max_k = spec.num_speculative_tokens
        self.step_time = step_time
        self.acceptance = AcceptanceModel(self.max_k, spec.acceptance_prior)
        self._steps_without_drafts: dict[str, int] = {}
        self._probing: set[str] = set()
        self._num_plans = 0
        self._held: tuple | None = None  # what the last plan was made for
        self._held_ks: list[int] = []  # its ks
        self._held_steps = 0  # steps it has been kept since
        self._observed = False  # a verification was observed since the last plan
        self._probe_credit = 0.0  # seconds of probing earned: PROBE_BUDGET of every step's predicted time
        # Adaptive n-gram drafts cost nothing to propose: every request proposes the most it may,
        # and the controller chooses how many of the drafts it holds to verify.
        self.free_proposals = spec.adaptive and self.method.free_proposal
        # chosen k per sampling request-step: drafts proposed (with free proposals: verified)
        self.k_histogram = [0] * (self.max_k + 1)
        self.num_timed_steps = 0
        self.predicted_s_total = 0.0
        self.measured_s_total = 0.0

    # ---- choosing -----------------------------------------------------------------------------
    def plan(self, reqs: list[PlanRequest], real_rows: int) -> Plan:
        """k for every scheduled request; ``real_rows``: the step's real (non-draft) tokens."""
        if self.spec.adaptive:
            held = (real_rows, tuple((r.req_id, r.samples, r.num_held, r.max_verify, r.max_propose) for r in reqs))
            drafting = any(self._held_ks)
            if (held == self._held and (drafting or not self._observed)
                    and self._held_steps + 1 < (DRAFTING_HOLD_STEPS if drafting else HOLD_STEPS)):
                ks = list(self._held_ks)
                self._held_steps += 1
            else:
                ks = self._adaptive_ks(reqs, real_rows)
                self._held, self._held_ks, self._held_steps = held, ks, 0
            self._observed = False
        else:
            k = self.spec.k_for_batch_size(len(reqs))
            ks = [k if r.samples else 0 for r in reqs]
        verify, propose = [], []
        self._num_plans += 1
        probes = set()
        if self.spec.adaptive and self._num_plans % PROBE_INTERVAL == 0:
            probes = self._choose_probes(reqs, ks, real_rows)
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if not r.samples:
                verify.append(0)
                propose.append(0)
                continue
            if self.free_proposals:  # k: drafts verified now, of those held; always propose the most
                wanted = 1 if i in probes else k
                verify.append(min(wanted, r.num_held, r.max_verify))
                propose.append(r.max_propose)
                chosen = verify[-1]
            else:
                wanted = r.num_held if r.req_id in self._probing else k
                self._probing.discard(r.req_id)
                verify.append(max(0, min(wanted, r.num_held, r.max_verify)))
                propose.append(min(k, r.max_propose))
                if i in probes:
                    propose[-1] = 1
                    self._probing.add(r.req_id)
                chosen = propose[-1]
            if self.spec.adaptive:
                idle = self._steps_without_drafts.get(r.req_id, 0) + 1 if chosen == 0 else 0
                self._steps_without_drafts[r.req_id] = idle
            self.k_histogram[chosen] += 1
        target_rows = real_rows + sum(verify)
        decode_only = real_rows == len(reqs) and target_rows == real_rows
        predicted = None
        if self.step_time is not None:
            ks_sampling = [p for p, r in zip(propose, reqs) if r.samples]
            predicted = self.step_time.predict(target_rows, len(reqs), real_rows, ks_sampling, decode_only)
            self._probe_credit += PROBE_BUDGET * predicted
        return Plan(verify, propose, target_rows, decode_only, predicted)

    def _adaptive_ks(self, reqs: list[PlanRequest], real_rows: int) -> list[int]:
        model = self.step_time
        rates = self.acceptance.engine_rates()
        ks = [0] * len(reqs)
        caps = np.zeros(len(reqs), dtype=np.int64)  # drafts worth considering per request
        for i, r in enumerate(reqs):
            if self.free_proposals:  # the drafts held now are what this step verifies
                cap = min(r.num_held, r.max_verify)
            else:  # steady state: k proposed now, verified next step (near its end a request may
                # verify one draft more than it may propose)
                cap = max(r.max_propose, min(r.num_held, r.max_verify))
            caps[i] = min(cap, self.max_k) if r.samples else 0
        considered = np.flatnonzero(caps > 0)  # [m] requests
        base_tokens = sum(r.samples for r in reqs)
        if not len(considered) or base_tokens == 0:
            return ks
        gains = self.acceptance.marginal_gains_of([reqs[i].req_id for i in considered], rates)  # [m, max_k]
        offered = np.arange(self.max_k)[None, :] < caps[considered][:, None]  # [m, max_k]
        most = int(offered.sum())
        # Drafts handed out one at a time to the largest next gain: a request's gains fall with its
        # draft index j, so that is every draft worth MIN_GAIN in order of gain (ties: the lower
        # request index, then the earlier draft), arrays over the drafts so handed out.
        row, draft_of = np.nonzero(offered & (gains >= MIN_GAIN))
        req_of, gain = considered[row], gains[row, draft_of]
        order = np.lexsort((draft_of, req_of, -gain))
        req_of, draft_of, gain = req_of[order], draft_of[order], gain[order]  # [n] by hand-out
        seqs = len(reqs)
        # Seconds of the step by drafts verified, and of the same sequences decoding one token
        # each (the same step where it has no prefill rows): without drafts a step of decodes
        # alone saves the verify jump; one draft gives it up (and makes a deferring drafter feed).
        shapes = [(real_rows, model.forward_by_drafts(real_rows, seqs, most))]
        if real_rows != seqs:
            shapes.append((seqs, model.forward_by_drafts(seqs, seqs, most)))
        passes = _draft_seconds(self.method, model.draft.at(np.arange(most + len(considered) + 1)), draft_of)  # [n]
        resume = np.zeros(len(gain))  # [n] the resumed requests' backlog feed, their share of this step
        if self.method.defers_feed and any(reqs[i].lag for i in considered):
            backlog = np.cumsum(np.where(draft_of == 0, [reqs[i].lag for i in req_of], 0))
            fed = model.feed.at(np.concatenate([[real_rows], real_rows + backlog]))  # beside the step's own feed
            resume = np.where(backlog > 0, (fed[1:] - fed[0]) / RESUME_STEPS, 0.0)
        seconds = []
        for rows, forward in shapes:
            none = forward[0] + model.feed(model.fed_rows(rows, False)) + model.overhead
            some = forward[1 : len(gain) + 1] + (model.feed(rows) + model.overhead) + passes + resume
            seconds.append(np.concatenate([[none], some]))  # [n + 1]
        tokens_np = np.cumsum(np.concatenate([[float(base_tokens)], gain]))  # [n + 1]
        step_s = seconds[0]
        if len(shapes) == 1:  # the step repeats as it is: the most tokens per second
            speed = tokens_np / step_s
            best_drafts = int(np.argmax(speed))
            worth = speed[best_drafts] >= MIN_SPEEDUP * speed[0]
        else:  # prefill rows make the step long whatever k is; beside them drafts would look cheap:
            # value a token at what the same sequences decoding make per second (λ) instead
            rate = float(np.max(tokens_np / np.asarray(seconds[1])))
            value = tokens_np - rate * step_s
            best_drafts = int(np.argmax(value))
            worth = value[best_drafts] - value[0] >= (MIN_SPEEDUP - 1.0) * tokens_np[0]  # net of their time
        if not worth:
            best_drafts = 0
        return np.bincount(req_of[:best_drafts], minlength=len(reqs)).tolist()

    def _choose_probes(self, reqs: list[PlanRequest], ks: list[int], real_rows: int) -> set[int]:
        """Indices of the requests that probe this step (see the module's docstring)."""
        room = (lambda r: min(r.num_held, r.max_verify)) if self.free_proposals else (lambda r: r.max_propose)
        idle = {
            i: self._steps_without_drafts.get(r.req_id, 0) + 1
            for i, (r, k) in enumerate(zip(reqs, ks)) if r.samples and k == 0 and room(r) > 0
        }
        candidates = sorted((i for i, n in idle.items() if n >= PROBE_INTERVAL), key=lambda i: -idle[i])
        if not candidates:
            return set()
        model, seqs = self.step_time, len(reqs)
        plain = model.forward(real_rows, seqs, real_rows == seqs)

        lags = [reqs[i].lag for i in candidates]

        def cost(m: int) -> float:  # m probes: the drafting pass now, m more rows verified next step
            passes = sum(model.draft(rows) for rows in self.method.draft_passes([1] * m))  # none for n-gram
            backlog = model.feed(sum(lags[:m]) + m) if self.method.defers_feed else 0.0
            return model.forward(real_rows + m, seqs, False) - plain + passes + backlog

        # Unspent credit carries over, up to an interval's earnings and one probe: where a single
        # probe costs more than an interval earns, probe steps are spaced out instead.
        self._probe_credit = min(self._probe_credit, PROBE_BUDGET * PROBE_INTERVAL * (plain + model.overhead) + cost(1))
        chosen = 0
        while chosen < len(candidates) and cost(chosen + 1) <= self._probe_credit:
            chosen += 1
        if chosen:
            self._probe_credit -= cost(chosen)
        return set(candidates[:chosen])

    # ---- learning -----------------------------------------------------------------------------
    def observe_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(req_id, num_drafts, num_accepted)
        self._observed = self._observed or num_drafts > 0

    def observe_step(
        self, plan: Plan, reqs: list[PlanRequest], target_s: float, drafter_s: float, drafter_fed_rows: int,
        step_s: float,
    ) -> None:
        """A step's measured phase times and the rows its drafter fed (from rank 0), and its wall
        time (on the driver)."""
        self.num_timed_steps += 1
        self.measured_s_total += step_s
        if self.step_time is None:
            return
        self.predicted_s_total += plan.predicted_s or 0.0
        ks = [p for p, r in zip(plan.num_propose, reqs) if r.samples]
        self.step_time.observe(
            plan.target_rows, len(reqs), drafter_fed_rows, ks, target_s, drafter_s, step_s, plan.decode_only
        )

    def forget(self, req_id: str) -> None:
        """A request ended: drop what was kept about it."""
        self.acceptance.forget(req_id)
        self._steps_without_drafts.pop(req_id, None)
        self._probing.discard(req_id)

    # ---- introspection ------------------------------------------------------------------------
    def as_dict(self) -> dict:
        n = sum(self.k_histogram)
        out = {
            "speculation_length": "adaptive" if self.spec.adaptive else "fixed",
            "num_speculative_tokens_histogram": list(self.k_histogram),
            "mean_num_speculative_tokens": sum(k * c for k, c in enumerate(self.k_histogram)) / n if n else 0.0,
            "acceptance_rate_per_pos_estimate": self.acceptance.engine_rates().tolist(),
            "num_timed_steps": self.num_timed_steps,
            "step_time_measured_s_total": self.measured_s_total,
        }
        if self.step_time is not None:
            out["step_time_predicted_s_total"] = self.predicted_s_total
            out["step_time_model"] = self.step_time.as_dict()
        return out


def _draft_seconds(method: SpeculativeMethod, pass_s: np.ndarray, draft_of: np.ndarray) -> np.ndarray:
    """Seconds of the drafting passes after each of the drafts handed out (``draft_of[d]``: the
    index j of draft d within its request), as ``SpeculativeMethod.draft_passes`` makes them;
    ``pass_s[r]``: one pass over r rows. -> [len(draft_of)]."""
    if method.drafting == LOOKUP:
        return np.zeros(len(draft_of))
    if method.drafting == BLOCK:  # one block pass: a request's first draft adds 2 rows, each later one 1
        return pass_s[np.cumsum(np.where(draft_of == 0, 2, 1))]
    # chains: pass j has a row per request with a draft j; each draft makes its pass one row longer
    if not len(draft_of):
        return np.zeros(0)
    of_pass = draft_of[:, None] == np.arange(int(draft_of.max()) + 1)[None, :]  # [n, passes]
    before = (np.cumsum(of_pass, axis=0) - of_pass)[np.arange(len(draft_of)), draft_of]  # [n] rows pass j had before draft d
    return np.cumsum(pass_s[before + 1] - pass_s[before])
