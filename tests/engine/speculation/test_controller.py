"""The speculation-length controller on synthetic acceptance rates and step-time curves: it picks
the k per request that maximizes expected tokens per second (checked against brute force), 0 when
no k pays, follows a static schedule or a pinned k when asked, probes requests held at k = 0,
and its models learn what they measure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tpspec.config import SpeculativeConfig
from tpspec.engine.speculation.acceptance import AcceptanceModel
from tpspec.engine.speculation.controller import (
    DRAFTING_HOLD_STEPS, HOLD_STEPS, MIN_SPEEDUP, PROBE_BUDGET, PROBE_INTERVAL, RESUME_STEPS, PlanRequest, SpeculationLengthController,
)
from tpspec.config.speculative_methods import get_method
from tpspec.engine.speculation import step_time
from tpspec.engine.speculation.step_time import PiecewiseLinear, StepTimeModel
from tpspec.spec_decode.step_profile import profile_grid

GRID = profile_grid(64)


def curve(fn) -> PiecewiseLinear:
    return PiecewiseLinear(GRID, [fn(x) for x in GRID])


def model(method: str, rows, draft, feed=lambda r: 0.0, seqs=lambda s: 0.0, verify_jump: float = 0.0) -> StepTimeModel:
    m = StepTimeModel(get_method(method), curve(rows), curve(seqs), curve(feed), curve(draft))
    m.verify_jump = PiecewiseLinear([1], [verify_jump])
    return m


def controller(method: str, k: int, step_time: StepTimeModel | None, **spec) -> SpeculationLengthController:
    return SpeculationLengthController(SpeculativeConfig(method=method, num_speculative_tokens=k, model=None if method == "ngram" else "x", **spec), step_time)


def set_rates(c: SpeculationLengthController, req_id: str, rates: list[float], n: int = 4000) -> None:
    """Feed verifications drawn from per-position conditional rates (deterministic)."""
    rng = np.random.default_rng(0)
    for _ in range(n):
        a = 0
        while a < len(rates) and rng.random() < rates[a]:
            a += 1
        c.observe_verification(req_id, len(rates), a)


def expected_rate(c: SpeculationLengthController, reqs: list[PlanRequest], ks: list[int], real_rows: int) -> float:
    rates = c.acceptance.engine_rates()
    tokens = sum(1 + float(np.sum(c.acceptance.marginal_gains(r.req_id, rates)[:k])) for r, k in zip(reqs, ks))
    return tokens / c.step_time.predict(real_rows + sum(ks), len(reqs), real_rows, ks, decode_only=sum(ks) == 0)


def req(i: int, k: int = 8) -> PlanRequest:
    return PlanRequest(f"r{i}", True, k, k, k)


@pytest.mark.parametrize("method", ["dflash", "eagle3", "ngram"])
@pytest.mark.parametrize("rates", [[0.9, 0.8, 0.7, 0.6], [0.5, 0.3, 0.3, 0.3]])
def test_plan_maximizes_tokens_per_second(method, rates):
    # A verification row costs 4% of a plain step, a drafting pass 10% plus 1% per row.
    c = controller(method, 4, model(method, lambda r: 1.0 + 0.04 * r, lambda r: 0.1 + 0.01 * r))
    reqs = [req(0, 4), req(1, 4), req(2, 4)]
    set_rates(c, "r0", rates)
    set_rates(c, "r1", [r * 0.5 for r in rates])
    set_rates(c, "r2", [0.99] * 4)
    plan = c.plan(reqs, 3)
    best = max(itertools.product(range(5), repeat=3), key=lambda ks: expected_rate(c, reqs, list(ks), 3))
    assert expected_rate(c, reqs, plan.num_propose, 3) == pytest.approx(expected_rate(c, reqs, list(best), 3), rel=1e-9)
    assert plan.num_verify == [min(k, 4) for k in plan.num_propose]
    assert plan.num_propose[2] >= plan.num_propose[0] >= plan.num_propose[1]  # better drafts, more of them


def test_the_drafters_measured_acceptance_is_the_prior():
    """Before any verification the rates are the drafter's recorded ones (later positions as the
    last), and a fast single stream speculates where the default prior (0.4) says it would not."""
    step = model("eagle3", lambda r: 1.0 + 0.45 * r, lambda r: 0.05)  # a second row: +31 % of the step
    default, measured = controller("eagle3", 4, step), controller("eagle3", 4, step, acceptance_prior=(0.55, 0.5))
    assert np.allclose(measured.acceptance.engine_rates(), [0.55, 0.5, 0.5, 0.5])
    assert default.acceptance.engine_rates()[0] == pytest.approx(0.4)
    assert default.plan([req(0)], 1).num_propose == [0]
    assert measured.plan([req(0)], 1).num_propose == [1]
    set_rates(measured, "r0", [0.2] * 4, n=400)  # the drafts turn out worse: measured rates take over
    assert measured.acceptance.engine_rates()[0] == pytest.approx(0.2, abs=0.03)
    assert measured.plan([req(1)], 1).num_propose == [0]


def test_an_unlucky_start_does_not_outweigh_the_drafters_measurement():
    """A first request whose first 5 verifications accept nothing leaves the engine-wide rate near
    the drafter's measured one (not at 2 / 9), so the next request still speculates; a drafter
    that really is worse is found out within a few dozen verifications."""
    step = model("eagle3", lambda r: 1.0 + 0.3 * r, lambda r: 0.05)  # a first draft pays from α_1 ≈ 0.33
    c = controller("eagle3", 4, step, acceptance_prior=(0.5, 0.5))
    assert c.plan([req(0)], 1).num_propose[0] >= 1
    for _ in range(5):
        c.observe_verification("r0", 2, 0)
    c.forget("r0")
    assert c.acceptance.engine_rates()[0] > 0.35
    assert c.plan([req(1)], 1).num_propose[0] >= 1
    for i in range(40):  # 1 in 10 accepted
        c.observe_verification("r1", 2, 0 if i % 10 else 1)
    c.forget("r1")
    assert c.plan([req(2)], 1).num_propose == [0]


def test_no_speculation_when_no_k_pays():
    c = controller("dflash", 8, model("dflash", lambda r: 1.0 + 0.5 * r, lambda r: 0.3 + 0.01 * r))
    set_rates(c, "r0", [0.3] * 8)
    plan = c.plan([req(0)], 1)
    assert plan.num_propose == [0] and plan.num_verify == [0]
    # Cheap rows and good drafts: speculate.
    c = controller("dflash", 8, model("dflash", lambda r: 1.0 + 0.01 * r, lambda r: 0.05))
    set_rates(c, "r0", [0.9] * 8)
    assert c.plan([req(0)], 1).num_propose[0] >= 4


def test_plans_are_kept_a_few_steps(monkeypatch):
    """No draft pays: the plan is kept for HOLD_STEPS steps while the requests stay the same and no
    verification is observed, and made again at once when either changes. A plan that gives drafts
    is kept for DRAFTING_HOLD_STEPS steps, its drafts' verifications notwithstanding."""
    c = controller("eagle3", 4, model("eagle3", lambda r: 1.0 + 0.5 * r, lambda r: 0.3 + 0.01 * r))
    set_rates(c, "r0", [0.3] * 4)
    made = []
    adaptive_ks = c._adaptive_ks
    monkeypatch.setattr(c, "_adaptive_ks", lambda reqs, rows: made.append(len(reqs)) or adaptive_ks(reqs, rows))
    held = [PlanRequest("r0", True, 0, 0, 4)]
    for _ in range(HOLD_STEPS + 1):
        assert c.plan(held, 1).num_propose == [0]
    assert len(made) == 2  # made, kept HOLD_STEPS - 1 steps, made again
    c.observe_verification("r0", 1, 1)  # a probe's verification: made again
    c.plan(held, 1)
    assert len(made) == 3
    c.plan(held + [PlanRequest("r1", True, 0, 0, 4)], 2)  # another request: made again
    assert len(made) == 4
    # Cheap rows now: the next plan that is made gives drafts, and is kept a few steps.
    c.step_time = model("eagle3", lambda r: 1.0 + 0.001 * r, lambda r: 0.01)
    set_rates(c, "r0", [0.95] * 4)
    drafting = [PlanRequest("r0", True, 4, 4, 4)]
    first = c.plan(drafting, 1).num_propose
    assert first[0] > 0 and len(made) == 5
    for _ in range(DRAFTING_HOLD_STEPS - 1):
        c.observe_verification("r0", first[0], first[0])
        assert c.plan(drafting, 1).num_propose == first
    assert len(made) == 5
    c.plan(drafting, 1)
    assert len(made) == 6
    c.plan([PlanRequest("r0", True, 4, 4, 3)], 1)  # its limits changed: made again
    assert len(made) == 7


def test_giving_up_the_decode_path_must_pay():
    """Decodes alone run a cheaper forward than any step with drafts: the first draft pays that jump."""
    c = controller("ngram", 4, model("ngram", lambda r: 0.6 + 0.01 * r, lambda r: 0.0, verify_jump=0.4))
    reqs = [req(i, 4) for i in range(8)]
    for i in range(8):
        set_rates(c, f"r{i}", [0.3] * 4, n=300)
    assert c.plan(reqs, 8).num_verify == [0] * 8  # without the jump, drafting would pay
    c2 = controller("ngram", 4, model("ngram", lambda r: 0.6 + 0.01 * r, lambda r: 0.0))
    for i in range(8):
        set_rates(c2, f"r{i}", [0.3] * 4, n=300)
    assert sum(c2.plan(reqs, 8).num_verify) > 0


def test_prefill_rows_do_not_make_drafts_pay():
    """A prefill chunk makes its step long whatever k is; against that step's own tokens per
    second every draft would look cheap. Drafts are valued at what the same sequences make
    decoding, so poor drafts stay off beside a prefill and good ones still pay."""
    c = controller("ngram", 4, model("ngram", lambda r: 1.0 + 0.1 * r, lambda r: 0.0))
    decodes = [req(i, 4) for i in range(4)]
    prefill = PlanRequest("p", True, 0, 0, 4)  # its last chunk: 200 rows, samples, holds no drafts
    for i in range(4):
        set_rates(c, f"r{i}", [0.2] * 4, n=300)
    assert c.plan(decodes, 4).num_verify == [0] * 4  # ~0.2 tokens for 0.1 s; a token costs 0.35 s
    assert c.plan(decodes + [prefill], 204).num_verify == [0] * 5
    set_rates(c, "r0", [0.95] * 4, n=300)
    assert c.plan(decodes + [prefill], 204).num_verify[0] == 4


def test_drafts_must_be_predicted_to_pay_by_a_margin():
    """Near break-even the step-time model's error decides, and a wrong guess lengthens every
    sequence's step: drafts predicted to gain less than MIN_SPEEDUP stay off."""
    assert MIN_SPEEDUP == 1.05
    for rate, drafts in ((0.13, False), (0.2, True)):  # one draft: +3.6 %, then +10 % predicted
        c = controller("ngram", 4, model("ngram", lambda r: 1.0 + 0.1 * r, lambda r: 0.0))
        set_rates(c, "r0", [rate] * 4, n=2000)
        speedup = expected_rate(c, [req(0, 4)], [1], 1) / expected_rate(c, [req(0, 4)], [0], 1)
        assert (speedup > MIN_SPEEDUP) == drafts and speedup > 1.0, speedup
        assert (c.plan([req(0, 4)], 1).num_verify[0] > 0) == drafts


def test_more_requests_fewer_drafts():
    """Rows get expensive once a batch is compute-bound: the same drafter pays less per request."""
    target = lambda r: 1.0 + 0.002 * r if r <= 16 else 1.03 + 0.02 * (r - 16)  # noqa: E731
    c = controller("eagle3", 8, model("eagle3", target, lambda r: 0.02 + 0.001 * r))
    for i in range(32):
        set_rates(c, f"r{i}", [0.7] * 8, n=200)
    alone = c.plan([req(0)], 1).num_propose[0]
    crowd = c.plan([req(i) for i in range(32)], 32).num_propose
    assert alone > max(crowd) and alone >= 4


def test_caps_held_drafts_and_partial_prefills():
    c = controller("dflash", 8, model("dflash", lambda r: 1.0 + 0.001 * r, lambda r: 0.01))
    set_rates(c, "r0", [0.95] * 8)
    set_rates(c, "r1", [0.95] * 8)
    reqs = [PlanRequest("r0", True, 2, 1, 8), PlanRequest("r1", False, 0, 0, 8)]  # r1: a partial prefill chunk
    plan = c.plan(reqs, 20)
    assert plan.num_verify == [1, 0] and plan.num_propose[1] == 0 and plan.num_propose[0] > 2
    assert plan.target_rows == 21


def test_ngram_proposes_the_most_and_verifies_what_it_holds():
    """n-gram drafts cost nothing to propose: adaptive, every request proposes all it may, and the
    controller spends verification rows only on drafts that exist, so a request whose lookup
    found nothing takes no share of them; held at k = 0, it is probed by verifying one held draft."""
    c = controller("ngram", 4, model("ngram", lambda r: 1.0 + 0.1 * r, lambda r: 0.0))
    for i in range(3):
        set_rates(c, f"r{i}", [0.5] * 4, n=300)
    reqs = [PlanRequest("r0", True, 0, 4, 4), PlanRequest("r1", True, 4, 4, 3), PlanRequest("r2", True, 2, 4, 4)]
    plan = c.plan(reqs, 3)
    assert plan.num_propose == [4, 3, 4]
    assert plan.num_verify[0] == 0 and plan.num_verify[1] > 0 and 0 < plan.num_verify[2] <= 2
    assert plan.target_rows == 3 + sum(plan.num_verify)
    assert expected_rate(c, reqs, plan.num_verify, 3) == pytest.approx(max(
        expected_rate(c, reqs, [0, a, b], 3) for a in range(5) for b in range(3)), rel=1e-9)
    # Poor drafts: nothing verified, and every PROBE_INTERVAL steps one held draft is.
    set_rates(c, "r1", [0.01] * 4, n=300)
    held = [PlanRequest("r1", True, 4, 4, 4)]
    verified = [c.plan(held, 1).num_verify[0] for _ in range(2 * PROBE_INTERVAL)]
    assert sorted(set(verified)) == [0, 1] and 1 <= verified.count(1) <= 2
    assert c.as_dict()["num_speculative_tokens_histogram"][1] >= 1  # chosen k: drafts verified


def test_fixed_and_static_schedules():
    fixed = controller("ngram", 5, None, adaptive=False)
    plan = fixed.plan([PlanRequest("a", True, 3, 2, 5), PlanRequest("b", True, 5, 5, 1)], 2)
    assert plan.num_verify == [2, 5] and plan.num_propose == [5, 1]
    static = controller("ngram", 5, None, num_speculative_tokens_per_batch_size=[[1, 1, 4], [2, 3, 1], [4, 8, 0]])
    assert not static.spec.adaptive
    assert static.plan([req(0)], 1).num_propose == [4]
    assert static.plan([req(0), req(1)], 2).num_propose == [1, 1]
    assert static.plan([req(i) for i in range(5)], 5).num_propose == [0] * 5
    assert static.plan([req(i) for i in range(9)], 9).num_propose == [5] * 9  # outside every row: the maximum
    assert static.as_dict()["num_speculative_tokens_histogram"] == [5, 2, 0, 0, 1, 9]


def test_requests_held_at_zero_are_probed_together():
    c = controller("dflash", 4, model("dflash", lambda r: 1.0, lambda r: 0.14))  # a verified row costs nothing
    set_rates(c, "r0", [0.1] * 4)
    held_none = [PlanRequest("r0", True, 0, 0, 4), PlanRequest("r1", True, 0, 0, 4)]
    proposed = [c.plan(held_none, 2).num_propose for _ in range(PROBE_INTERVAL)]
    assert proposed == [[0, 0]] * (PROBE_INTERVAL - 1) + [[1, 1]]  # both in the same step
    # A probe's draft is verified next step even though k = 0 is chosen again.
    plan = c.plan([PlanRequest("r0", True, 1, 1, 4), PlanRequest("r1", True, 1, 1, 4)], 2)
    assert plan.num_verify == [1, 1] and plan.num_propose == [0, 0]
    # A request that joined late waits a whole interval, then the next probe step.
    late = PlanRequest("r2", True, 0, 0, 4)
    proposed = [c.plan([late], 1).num_propose[0] for _ in range(2 * PROBE_INTERVAL)]
    assert proposed.count(1) == 1 and proposed.index(1) >= PROBE_INTERVAL - 1


def test_probes_within_budget_longest_idle_first():
    """Where every probed row costs, a probe step probes only as many requests as the credit
    (PROBE_BUDGET of the steps since the last one, and what that left) pays for, those idle
    longest first, so each is probed in turn."""
    n, per_row, pass_s = 32, 0.1, 0.3
    c = controller("dflash", 4, model("dflash", lambda r: 1.0 + per_row * r, lambda r: pass_s))
    set_rates(c, "r0", [0.05] * 4)
    plain = 1.0 + per_row * n
    cost = lambda m: per_row * m + pass_s  # noqa: E731  m more rows verified, one pass
    expected = max(m for m in range(1, n + 1) if cost(m) <= PROBE_BUDGET * PROBE_INTERVAL * plain)
    assert 1 < expected < n
    reqs = [PlanRequest(f"r{i}", True, 0, 0, 4) for i in range(n)]
    probed: list[list[int]] = []
    last = dict.fromkeys(range(n), -1)  # the step each request last probed at
    steps = PROBE_INTERVAL * (n // expected + 1)
    for step in range(steps):
        proposed = c.plan(reqs, n).num_propose
        p = [i for i, k in enumerate(proposed) if k]
        if p:
            idle = {i: step - last[i] for i in range(n)}
            assert min(idle[i] for i in p) >= max(idle[i] for i in range(n) if i not in p)  # longest idle first
            last.update(dict.fromkeys(p, step))
            probed.append(p)
    assert all(len(p) in (expected, expected + 1) for p in probed)  # + 1: credit left by earlier ones
    assert sum(cost(len(p)) for p in probed) <= PROBE_BUDGET * steps * (plain + per_row)
    assert probed[0] == list(range(expected)) and min(last.values()) >= 0  # ties in step order; all in turn


def test_probes_cost_their_budget_when_one_costs_more_than_an_interval_earns():
    """A drafting pass beside one fast decode: a probe costs 40% of a step, more than an
    interval's 1% budget earns, so probe steps come about every cost / (budget · step) steps
    instead of every PROBE_INTERVAL, and probing costs about PROBE_BUDGET of the time."""
    step, pass_s = 1.0, 0.4
    c = controller("dflash", 4, model("dflash", lambda r: step, lambda r: pass_s))
    set_rates(c, "r0", [0.05] * 4)
    reqs = [PlanRequest("r0", True, 0, 0, 4)]
    n = 100 * PROBE_INTERVAL
    probes = sum(c.plan(reqs, 1).num_propose[0] for _ in range(n))
    spent = probes * pass_s
    cap = PROBE_BUDGET * PROBE_INTERVAL * step + pass_s  # credit carried over at most
    assert PROBE_BUDGET * n * step - cap <= spent <= PROBE_BUDGET * (n * step + spent)
    assert probes < n // PROBE_INTERVAL // 2  # the old rule: at least one every interval


def test_resuming_a_held_request_pays_a_share_of_its_backlog_feed():
    """A deferring drafter feeds a held request's backlog in the step it proposes again: that step
    is charged 1 / RESUME_STEPS of the feed, so a draft that pays alone does not pay with a long
    backlog; a drafter that does not defer (n-gram) is charged nothing."""
    feed_per_row, step = 0.01, 1.0
    for lag, resumes in ((0, True), (RESUME_STEPS * 200, False)):
        c = controller("eagle3", 4, model("eagle3", lambda r: step + 0.05 * r, lambda r: 0.05,
                                          feed=lambda r: feed_per_row * r))
        set_rates(c, "r0", [0.6] * 4)
        assert (sum(c.plan([PlanRequest("r0", True, 0, 0, 4, lag)], 1).num_propose) > 0) == resumes
    # Past some backlog, none (before that, a fixed cost can make more drafts the best way to pay it).
    c = controller("eagle3", 4, model("eagle3", lambda r: step + 0.05 * r, lambda r: 0.05, feed=lambda r: feed_per_row * r))
    set_rates(c, "r0", [0.6] * 4)
    ks = [c.plan([PlanRequest("r0", True, 0, 0, 4, lag)], 1).num_propose[0] for lag in range(0, 4000, 100)]
    assert ks[0] > 0 and ks[-1] == 0 and not any(ks[ks.index(0):])


def test_a_probe_is_charged_its_requests_whole_backlog():
    """Probing a held request feeds its backlog: probes of requests with long backlogs cost more
    of the credit, so fewer of them share a probe step."""
    n, per_row, pass_s = 32, 0.1, 0.3

    def probed_per_step(lag: int) -> int:
        c = controller("eagle3", 4, model("eagle3", lambda r: 1.0 + per_row * r, lambda r: pass_s,
                                          feed=lambda r: 0.002 * r))
        set_rates(c, "r0", [0.05] * 4)
        reqs = [PlanRequest(f"r{i}", True, 0, 0, 4, lag) for i in range(n)]
        return max(sum(1 for k in c.plan(reqs, n).num_propose if k) for _ in range(PROBE_INTERVAL))

    assert probed_per_step(0) > probed_per_step(64) >= 1


def test_acceptance_estimates_converge_and_shrink_to_the_engine():
    m = AcceptanceModel(3)
    rng = np.random.default_rng(1)
    true = [0.8, 0.5, 0.9]
    for _ in range(3000):
        a = 0
        while a < 3 and rng.random() < true[a]:
            a += 1
        m.observe("a", 3, a)
    np.testing.assert_allclose(m.engine_rates(), true, atol=0.08)
    np.testing.assert_allclose(m.marginal_gains("a"), np.cumprod(m.request_rates("a")))
    # A request never seen takes the engine's rates; a short history pulls it part of the way.
    np.testing.assert_allclose(m.request_rates("new"), m.engine_rates())
    for _ in range(8):
        m.observe("b", 3, 0)
    assert m.request_rates("b")[0] < m.engine_rates()[0] - 0.2
    m.observe("c", 3, 0)  # one rejection moves a request only a little
    assert m.request_rates("c")[0] > m.engine_rates()[0] - 0.1
    m.forget("b")
    np.testing.assert_allclose(m.request_rates("b"), m.engine_rates())


def test_attention_over_contexts_is_paid_with_or_without_drafts():
    """A profile whose decodes of many sequences cost far more than the same rows in few long
    sequences (attention over each context): that cost is the sequences', paid whatever k is, so
    with expensive rows and poor drafts a crowded step does not speculate; a model that folded it
    into the decode step's curve alone would see drafts as nearly free."""
    k = 4
    profile = {"rows_grid": GRID, "rows_s": [1.0 + 0.04 * r for r in GRID], "feed_s": [0.0] * len(GRID),
               "draft_pass_s": [0.0] * len(GRID), "seqs_grid": GRID, "decode_s": [1.0 + 0.04 * s + 0.05 * s for s in GRID]}
    stm = StepTimeModel.from_profile(get_method("ngram"), profile)
    assert stm.predict(32, 32, 32, [], decode_only=True) == pytest.approx(1.0 + 0.09 * 32)
    assert stm.predict(40, 32, 32, [1] * 8) == pytest.approx(1.0 + 0.04 * 40 + 0.05 * 32)
    c = controller("ngram", k, stm)
    reqs = [req(i, k) for i in range(32)]
    for i in range(32):
        set_rates(c, f"r{i}", [0.2] * k, n=300)
    assert c.plan(reqs, 32).num_verify == [0] * 32  # a draft adds ~0.2 tokens for 0.04 s; a token costs 0.12 s
    set_rates(c, "r0", [0.95] * k, n=300)
    assert c.plan(reqs, 32).num_verify[0] == k  # one request with good drafts still speculates


def test_step_time_model_learns_the_measured_curve():
    def truth(rows: int, seqs: int, decode_only: bool) -> float:
        return 0.3 + 0.02 * rows + 0.01 * seqs + (0.0 if decode_only else 0.1)

    stm = model("ngram", lambda r: 0.2 + 0.01 * r, lambda r: 0.0)
    rng = np.random.default_rng(2)
    for _ in range(3000):
        seqs = int(rng.integers(1, 64))
        rows = seqs + int(rng.integers(0, 64))
        for r, decode_only in ((rows, False), (seqs, True)):
            t = truth(r, seqs, decode_only)
            stm.observe(r, seqs, r, [], t, 0.0, t + 0.004, decode_only=decode_only)
    for seqs, rows in ((1, 1), (1, 16), (8, 40), (32, 32), (32, 90), (60, 100)):
        for decode_only in (False, True) if rows == seqs else (False,):
            expected = truth(rows, seqs, decode_only) + 0.004
            assert stm.predict(rows, seqs, rows, [], decode_only=decode_only) == pytest.approx(expected, rel=0.05)
    assert stm.overhead == pytest.approx(0.004, rel=0.05)


def test_a_slower_machine_leaves_the_cost_of_more_rows_as_profiled():
    """Steps of 32 decodes measured far slower than profiled (a slower machine, longer contexts)
    raise what the model predicts for them, and for larger steps as much: 16 more rows still cost
    what the profile says, not nothing (the controller would then verify drafts for free)."""
    stm = model("eagle3", lambda r: 0.2 + 0.01 * r, lambda r: 0.0, seqs=lambda s: 0.001 * s)
    marginal = stm.forward(48, 32, False) - stm.forward(32, 32, False)
    for _ in range(200):
        t = 0.2 + 0.01 * 32 + 0.001 * 32 + 1.0  # a second slower than the profile
        stm.observe(32, 32, 0, [0] * 32, t, 0.0, t, decode_only=True)
    assert stm.forward(32, 32, True) == pytest.approx(0.2 + 0.32 + 0.032 + 1.0, rel=0.01)
    assert stm.forward(48, 32, False) - stm.forward(32, 32, False) == pytest.approx(marginal, rel=0.01)


def test_one_stalled_step_does_not_stop_drafts_that_pay():
    """A stream whose drafts pay 18 % more tokens per second: one drafting step whose target phase
    stalls (10x its prediction) must not tip the next plan to no drafts. (With a phase counted up to
    2x its prediction, the stall raised the verify jump, which only drafting steps teach, with the
    rows and sequences curves, and the next plan held the stream at k = 0.)"""
    c = controller("eagle3", 4, model("eagle3", lambda r: 1.0 + 0.3 * r, lambda r: 0.05), acceptance_prior=(0.5, 0.5))
    plan = c.plan([req(0)], 1)
    assert plan.num_propose == [1]
    target = c.step_time.forward(2, 1, False)
    c.observe_step(plan, [req(0)], 10 * target, 0.05, 1, 10 * target + 0.05)
    assert c.plan([req(1)], 1).num_propose == [1]


def test_one_stall_moves_the_curves_no_more_than_a_step_max_error_ratio_times_as_slow():
    """A drafter phase 50x its prediction (a garbage collection, a preempted thread: served at one
    stream, after one such step EAGLE-3 proposed in 93 of the next 1,173 steps) corrects the curves as one
    measured at MAX_ERROR_RATIO times the prediction does; a drafter really 3x slower than profiled
    is still learned, over a few more steps."""
    def fresh() -> StepTimeModel:
        return model("eagle3", lambda r: 0.005 + 0.0005 * r, lambda r: 0.0004 + 0.0001 * r, feed=lambda r: 0.0005 * r)

    predicted = fresh().predict(4, 1, 1, [3]) - fresh().forward(4, 1, False)  # the drafter's share: feed 1 row, 3 passes
    stalled, slow = fresh(), fresh()
    stalled.observe(4, 1, 1, [3], 0.0065, 50 * predicted, 0.0065 + 50 * predicted)
    slow.observe(4, 1, 1, [3], 0.0065, step_time.MAX_ERROR_RATIO * predicted, 0.0065 + step_time.MAX_ERROR_RATIO * predicted)
    assert stalled.draft.values() == slow.draft.values() and stalled.feed.values() == slow.feed.values()
    assert stalled.draft(1) > fresh().draft(1)  # it still counts, as a step MAX_ERROR_RATIO times as slow
    learner = fresh()
    for _ in range(60):
        learner.observe(4, 1, 1, [3], 0.0065, 3 * predicted, 0.0065 + 3 * predicted)
    assert learner.predict(4, 1, 1, [3]) - learner.forward(4, 1, False) == pytest.approx(3 * predicted, rel=0.02)


def test_curve_lookups_agree():
    c = PiecewiseLinear([1, 2, 8, 32], [0.5, 0.6, 0.9, 2.0])
    xs = np.arange(0, 80)
    np.testing.assert_allclose(c.at(xs), [c(int(x)) for x in xs])
    assert c(0) == 0.0 and c(64) == pytest.approx(2.0 + 32 * 1.1 / 24)


def test_draft_passes_by_method():
    assert get_method("dflash").draft_passes([0, 3, 1]) == [6]
    assert get_method("eagle3").draft_passes([0, 3, 1]) == [2, 1, 1]
    assert get_method("draft_model").draft_passes([]) == []
    assert get_method("ngram").draft_passes([5]) == []


@pytest.mark.parametrize("spec, match", [
    (dict(adaptive="yes"), "adaptive must be true or false"),
    (dict(adaptive=True, num_speculative_tokens_per_batch_size=[[1, 4, 2]]), "static schedule"),
    (dict(num_speculative_tokens_per_batch_size=[]), "non-empty list"),
    (dict(num_speculative_tokens_per_batch_size=[[1, 4]]), r"\[start, end, k\]"),
    (dict(num_speculative_tokens_per_batch_size=[[0, 4, 1]]), "start must be >= 1"),
    (dict(num_speculative_tokens_per_batch_size=[[5, 4, 1]]), "end must be >= 5"),
    (dict(num_speculative_tokens_per_batch_size=[[1, 4, 9]]), r"k must be in \[0, 5\]"),
    (dict(num_speculative_tokens_per_batch_size=[[1, 4, 1], [4, 8, 2]]), "overlap at batch size 4"),
])
def test_bad_speculation_length_config(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        SpeculativeConfig.from_dict(dict(method="ngram", num_speculative_tokens=5, **spec))
    assert "speculative_config" in str(e.value)


def test_speculation_length_config_defaults():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).adaptive is True
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False).adaptive is False
    s = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"num_speculative_tokens_per_batch_size": [[9, 16, 0], [1, 8, 2]]}')
    assert s.adaptive is False and s.num_speculative_tokens_per_batch_size == ((1, 8, 2), (9, 16, 0))
    assert [s.k_for_batch_size(b) for b in (1, 8, 9, 16, 17)] == [2, 2, 0, 0, 3]
