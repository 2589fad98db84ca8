"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Engine-wide numbers (queue sizes, KV usage, token counters, speculative decoding, communication)
come from a snapshot of ``LLMEngine.get_stats()`` taken on each scrape; per-request latencies
(TTFT, time per output token, end-to-end), finished requests and errors by kind are recorded by
the server as requests end. Names mirror vLLM's ``vllm:*`` metrics with the ``tpspec:`` prefix.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineStatsCollector:
    """Turns the latest ``get_stats()`` snapshot into metric families at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def describe(self):  # nothing to pre-register: names are fixed and unique in this registry
        return []

    def collect(self):
        s, m = self.stats, self.model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([m], float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([m], float(value))
            return c

        yield gauge("tpspec:num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("tpspec:num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("tpspec:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.get("kv_cache_usage", 0.0))
        yield gauge("tpspec:num_kv_blocks", "KV cache blocks in total.", s.get("num_kv_blocks", 0))
        yield gauge("tpspec:num_free_kv_blocks", "KV cache blocks free.", s.get("num_free_kv_blocks", 0))
        yield counter("tpspec:prompt_tokens", "Prompt tokens accepted by the engine.", s.get("num_prompt_tokens", 0))
        yield counter("tpspec:generation_tokens", "Tokens generated.", s.get("num_generation_tokens", 0))
        yield counter("tpspec:num_preemptions", "Requests preempted (KV cache full).", s.get("num_preemptions", 0))
        yield counter("tpspec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at admission).",
                      s.get("prefix_cache_queries", 0))
        yield counter("tpspec:prefix_cache_hits", "Of those, tokens found cached (not computed).",
                      s.get("prefix_cache_hits", 0))
        if "num_drafts" in s:
            yield counter("tpspec:spec_decode_num_drafts", "Verification rounds with at least one draft token.", s["num_drafts"])
            yield counter("tpspec:spec_decode_num_draft_tokens", "Draft tokens proposed.", s["num_draft_tokens"])
            yield counter("tpspec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["num_accepted_tokens"])
            per_pos = CounterMetricFamily(
                "tpspec:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                labels=["model_name", "position"],
            )
            for pos, n in enumerate(s.get("num_accepted_tokens_per_pos", [])):
                per_pos.add_metric([m, str(pos)], float(n))
            yield per_pos
            drafted = CounterMetricFamily(
                "tpspec:spec_decode_num_draft_tokens_per_pos",
                "Draft tokens verified, by position in the draft (with a varying k, a position's acceptance "
                "rate is accepted / verified there).",
                labels=["model_name", "position"],
            )
            for pos, n in enumerate(s.get("num_draft_tokens_per_pos", [])):
                drafted.add_metric([m, str(pos)], float(n))
            yield drafted
            yield from self._speculation_length(s)
        comm = s.get("comm", {})
        calls = CounterMetricFamily("tpspec:comm_calls", "Collective calls on the driver rank, by call site.", labels=["model_name", "site"])
        nbytes = CounterMetricFamily("tpspec:comm_bytes", "Bytes sent through collectives on the driver rank, by call site.", labels=["model_name", "site"])
        cross = CounterMetricFamily(
            "tpspec:comm_cross_node_bytes",
            "Of tpspec:comm_bytes, the bytes of collectives that crossed nodes (a multi-node engine), by call site.",
            labels=["model_name", "site"],
        )
        for site, c in comm.items():
            calls.add_metric([m, site], float(c.get("calls", 0)))
            nbytes.add_metric([m, site], float(c.get("bytes", 0)))
            cross.add_metric([m, site], float(c.get("cross_node_bytes", 0)))
        yield calls
        yield nbytes
        yield cross
        per_row = GaugeMetricFamily(
            "tpspec:comm_bytes_per_sampled_row",
            "Collective bytes per sampled row on the driver rank, by sampling site (draft.sample, verify.sample, sample).",
            labels=["model_name", "site"],
        )
        for site, value in s.get("comm_bytes_per_row", {}).items():
            per_row.add_metric([m, site], float(value))
        yield per_row


    def _speculation_length(self, s: dict[str, Any]):
        """The chosen k per request-step (a histogram with one bucket per k) and the controller's
        predicted vs measured step time."""
        m = self.model_name
        hist = s.get("num_speculative_tokens_histogram")
        if hist is None:
            return
        h = HistogramMetricFamily(
            "tpspec:spec_decode_num_speculative_tokens",
            "Draft tokens proposed per request and step (the chosen speculation length k).",
            labels=["model_name"],
        )
        cumulative, buckets = 0, []
        for k, n in enumerate(hist):
            cumulative += n
            buckets.append((str(k), float(cumulative)))
        buckets.append(("+Inf", float(cumulative)))
        h.add_metric([m], buckets, float(sum(k * n for k, n in enumerate(hist))))
        yield h
        for name, key, doc in (
            ("step_time_measured_seconds", "step_time_measured_s_total", "Engine step wall time, summed over steps."),
            ("step_time_predicted_seconds", "step_time_predicted_s_total",
             "The speculation-length controller's predicted step time, summed over the same steps."),
            ("num_timed_steps", "num_timed_steps", "Engine steps timed for the speculation-length controller."),
        ):
            if key in s:
                c = CounterMetricFamily(f"tpspec:spec_decode_{name}", doc, labels=["model_name"])
                c.add_metric([m], float(s[key]))
                yield c


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self.request_success = Counter(
            "tpspec:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.request_errors = Counter(
            "tpspec:request_errors", "HTTP requests that ended in an error, by kind (the error's code).",
            ["model_name", "kind"], registry=self.registry,
        )
        self.ttft = Histogram(
            "tpspec:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "tpspec:time_per_output_token_seconds", "Per request: (latency - TTFT) / (output tokens - 1).",
            labels, buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "tpspec:e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry,
        )

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        self._engine.stats = stats

    def observe_request(
        self, ttft: float | None, latency: float, num_output_tokens: int, finish_reason: str | None
    ) -> None:
        m = self.model_name
        self.request_success.labels(m, finish_reason or "unknown").inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if num_output_tokens > 1:
                self.tpot.labels(m).observe((latency - ttft) / (num_output_tokens - 1))
        self.e2e.labels(m).observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
