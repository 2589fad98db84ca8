"""``bench.metrics`` on synthetic timings, every figure against a hand computation.

Requests (times in seconds; A and B stream several tokens per chunk, as speculative decoding does):

    A: start 0.00, chunks 0.10 0.15 0.25 0.30, prompt 10, output 5
       TTFT 0.10, E2E 0.30, TPOT (0.30 - 0.10) / (5 - 1) = 0.05, ITL 0.05 0.10 0.05
    B: start 0.05, chunks 0.25 0.45,           prompt 20, output 3
       TTFT 0.20, E2E 0.40, TPOT (0.40 - 0.20) / (3 - 1) = 0.10, ITL 0.20
    C: start 0.10, chunk 0.40,                 prompt 30, output 1
       TTFT 0.30, E2E 0.30, no TPOT (one token), no ITL
    D: start 0.20, failed                      (excluded from everything but the failed count)

Duration 0.5 s. Percentiles interpolate linearly between order statistics (numpy's default, as
vLLM): p99 of n sorted values x0..x(n-1) = x_k + f (x_(k+1) - x_k) with k + f = 0.99 (n - 1).
"""

from __future__ import annotations

import math

import pytest

from tpspec.bench.metrics import RequestRecord, SpecDecodeDelta, compute_metrics, parse_metrics, spec_decode_delta
from tpspec.server.metrics import ServerMetrics

A = RequestRecord(start=0.00, chunk_times=(0.10, 0.15, 0.25, 0.30), prompt_tokens=10, output_tokens=5, success=True)
B = RequestRecord(start=0.05, chunk_times=(0.25, 0.45), prompt_tokens=20, output_tokens=3, success=True)
C = RequestRecord(start=0.10, chunk_times=(0.40,), prompt_tokens=30, output_tokens=1, success=True)
D = RequestRecord(start=0.20, success=False, error="HTTP 500: boom")
DURATION = 0.5


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_request_level_figures():
    assert A.ttft == pytest.approx(0.10) and A.latency == pytest.approx(0.30)
    assert A.itl == pytest.approx([0.05, 0.10, 0.05])
    assert C.itl == [] and C.ttft == C.latency == pytest.approx(0.30)


def test_every_figure_matches_the_hand_computation():
    m = compute_metrics([A, B, C, D], DURATION)
    assert (m.completed, m.failed) == (3, 1)
    assert m.duration_s == DURATION
    assert m.total_input_tokens == 10 + 20 + 30
    assert m.total_output_tokens == 5 + 3 + 1
    assert m.request_throughput == pytest.approx(3 / 0.5)
    assert m.output_throughput == pytest.approx(9 / 0.5)
    assert m.total_token_throughput == pytest.approx((60 + 9) / 0.5)

    # TTFT ms: 100, 200, 300 -> p99 rank 0.99 * 2 = 1.98 -> 200 + 0.98 * 100
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.p99_ttft_ms == pytest.approx(298.0)
    assert m.std_ttft_ms == pytest.approx(_std([100, 200, 300]))
    # TPOT ms: A 50, B 100; C (1 token) excluded -> p99 rank 0.99 -> 50 + 0.99 * 50
    assert m.mean_tpot_ms == pytest.approx(75.0)
    assert m.median_tpot_ms == pytest.approx(75.0)
    assert m.p99_tpot_ms == pytest.approx(99.5)
    # ITL ms pooled: 50, 100, 50, 200 -> sorted 50 50 100 200; median 75; p99 rank 2.97 -> 100 + 0.97 * 100
    assert m.mean_itl_ms == pytest.approx(100.0)
    assert m.median_itl_ms == pytest.approx(75.0)
    assert m.p99_itl_ms == pytest.approx(197.0)
    assert m.std_itl_ms == pytest.approx(_std([50, 100, 50, 200]))
    # E2E ms: 300, 400, 300 -> sorted 300 300 400; p99 rank 1.98 -> 300 + 0.98 * 100
    assert m.mean_e2el_ms == pytest.approx(1000 / 3)
    assert m.median_e2el_ms == pytest.approx(300.0)
    assert m.p99_e2el_ms == pytest.approx(398.0)
    # no counters given: the speculative figures are unknown, not zero
    assert m.spec_decode_acceptance_length is None and m.draft_bytes_per_draft_token is None


def test_wrong_definitions_would_fail():
    """Plausible mistakes give different numbers on this data, so the test above pins the definitions."""
    m = compute_metrics([A, B, C, D], DURATION)
    naive_tpot = [r.latency / r.output_tokens for r in (A, B, C)]  # latency / tokens, 1-token request included
    assert m.mean_tpot_ms != pytest.approx(1000 * sum(naive_tpot) / 3)
    with_single = [50.0, 100.0, 0.0]  # the 1-token request counted as TPOT 0
    assert m.mean_tpot_ms != pytest.approx(sum(with_single) / 3)
    assert m.mean_tpot_ms != pytest.approx(m.mean_itl_ms)  # TPOT is per token, ITL per chunk
    assert m.total_input_tokens == 60  # the failed request's prompt is not counted
    assert m.request_throughput != pytest.approx(4 / DURATION)


def test_no_data_is_none_not_zero():
    m = compute_metrics([C, D], DURATION)  # only a 1-token request succeeded
    assert m.completed == 1 and m.mean_tpot_ms is None and m.p99_itl_ms is None
    assert m.mean_ttft_ms == pytest.approx(300.0)
    empty = compute_metrics([D], DURATION)
    assert empty.completed == 0 and empty.mean_ttft_ms is None and empty.output_throughput == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([A], 0.0)


def test_record_validation():
    with pytest.raises(ValueError, match="chunk_times"):
        RequestRecord(start=0.0, success=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        RequestRecord(start=0.0, chunk_times=(0.2, 0.1), success=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        RequestRecord(start=1.0, chunk_times=(0.5,), success=True)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestRecord(start=0.0, chunk_times=(0.1,), output_tokens=-1, success=True)


def _scrape(**stats) -> dict:
    """What the real server's /metrics says for these engine stats, parsed."""
    m = ServerMetrics("tiny")
    m.update_engine_stats(stats)
    return parse_metrics(m.render().decode())


BEFORE = dict(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12, num_accepted_tokens_per_pos=[6, 4, 2],
              comm={"draft.sample": {"calls": 30, "bytes": 480}, "layer.all_reduce": {"calls": 9, "bytes": 99999}})
AFTER = dict(num_drafts=30, num_draft_tokens=90, num_accepted_tokens=57, num_accepted_tokens_per_pos=[24, 18, 15],
             comm={"draft.sample": {"calls": 90, "bytes": 1920}, "layer.all_reduce": {"calls": 99, "bytes": 10 ** 7}})


def test_speculation_length_figures_from_the_servers_metric_deltas():
    """tpspec's k varies: per-position rates divide by the drafts verified at that position, and the
    chosen-k histogram gives the run's mean k."""
    before = dict(BEFORE, num_draft_tokens_per_pos=[10, 10, 10], num_speculative_tokens_histogram=[5, 0, 0, 10],
                  step_time_measured_s_total=1.0, step_time_predicted_s_total=0.9, num_timed_steps=15)
    after = dict(AFTER, num_draft_tokens_per_pos=[30, 26, 24], num_speculative_tokens_histogram=[25, 4, 6, 20],
                 step_time_measured_s_total=4.0, step_time_predicted_s_total=3.5, num_timed_steps=55)
    delta = spec_decode_delta(_scrape(**before), _scrape(**after))
    assert delta.num_drafted_per_pos == (20, 16, 14)
    # k histogram deltas: 20 steps at k = 0, 4 at 1, 6 at 2, 10 at 3: 4 + 12 + 30 = 46 drafts over 40 request-steps
    assert (delta.num_speculative_tokens_sum, delta.num_speculative_tokens_count) == (46, 40)
    m = compute_metrics([A, B], DURATION, delta)
    assert m.spec_decode_mean_num_speculative_tokens == pytest.approx(46 / 40)
    assert m.spec_decode_per_position_acceptance_rate == pytest.approx((18 / 20, 14 / 16, 13 / 14))


def test_spec_decode_figures_from_the_servers_metric_deltas():
    delta = spec_decode_delta(_scrape(**BEFORE), _scrape(**AFTER))
    # deltas: 20 drafts, 60 draft tokens, 45 accepted (18, 14, 13 by position), 1440 draft.sample bytes
    assert delta == SpecDecodeDelta(20, 60, 45, (18, 14, 13), 1440)
    m = compute_metrics([A], DURATION, delta)
    assert m.spec_decode_acceptance_rate == pytest.approx(45 / 60)  # 0.75
    assert m.spec_decode_acceptance_length == pytest.approx(1 + 45 / 20)  # 3.25, not 1 + 45 / 60
    assert m.spec_decode_per_position_acceptance_rate == pytest.approx((18 / 20, 14 / 20, 13 / 20))
    assert m.draft_bytes_per_draft_token == pytest.approx(1440 / 60)  # other sites' bytes not counted
    assert (m.spec_decode_num_drafts, m.spec_decode_num_draft_tokens, m.spec_decode_num_accepted_tokens) == (20, 60, 45)
    assert m.to_dict()["spec_decode_per_position_acceptance_rate"] == pytest.approx([0.9, 0.7, 0.65])


def test_absent_counters_give_none():
    plain = _scrape(num_running=1)  # a tpspec server without speculation
    assert spec_decode_delta(plain, plain) is None
    assert spec_decode_delta(None, _scrape(**AFTER)) is None  # a scrape failed
    assert spec_decode_delta({}, {}) is None  # no /metrics at all (llama.cpp without --metrics)
    no_comm = {k: v for k, v in AFTER.items() if k != "comm"}  # TP 1: no collectives, no draft.sample site
    delta = spec_decode_delta(_scrape(**{k: v for k, v in BEFORE.items() if k != "comm"}), _scrape(**no_comm))
    assert delta.draft_sample_bytes is None
    m = compute_metrics([A], DURATION, delta)
    assert m.draft_bytes_per_draft_token is None and m.spec_decode_acceptance_length == pytest.approx(3.25)
    assert compute_metrics([A], DURATION, SpecDecodeDelta(0, 0, 0)).spec_decode_acceptance_length is None


def test_vllm_counter_names_are_understood():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter", 'vllm:spec_decode_num_drafts_total{model_name="m"} 8',
        "# TYPE vllm:spec_decode_num_draft_tokens counter", 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 24',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter", 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5', "",
    ])
    delta = spec_decode_delta({}, parse_metrics(text))  # counters that did not exist before start at 0
    assert delta == SpecDecodeDelta(8, 24, 12, (7, 5), None)


def test_prefix_cache_hit_rate_from_the_servers_metric_deltas():
    from tpspec.bench.metrics import prefix_cache_delta
    from tpspec.bench.report import format_serve_table

    before = _scrape(prefix_cache_queries=1000, prefix_cache_hits=200)
    after = _scrape(prefix_cache_queries=5000, prefix_cache_hits=3200)
    delta = prefix_cache_delta(before, after)
    assert delta == {"prefix_cache_queries": 4000, "prefix_cache_hits": 3000, "prefix_cache_hit_rate": 0.75}
    vllm = {(name.replace("tpspec:", "vllm:"), labels): v for (name, labels), v in after.items()}
    assert prefix_cache_delta({}, vllm)["prefix_cache_hits"] == 3200  # vLLM's names, counted from zero
    assert prefix_cache_delta(None, after) is None and prefix_cache_delta({}, {}) is None
    m = compute_metrics([A], DURATION, None).to_dict()
    table = format_serve_table({**m, **delta, "completed": 1, "failed": 0})
    assert "Prefix Cache" in table and "75.00" in table
