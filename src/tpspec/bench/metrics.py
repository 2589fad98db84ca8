"""Serving-benchmark figures from per-request timings and ``/metrics`` deltas, as ``vllm bench serve``.

Definitions (all over *successful* requests, times in the result in milliseconds):

* TTFT: first streamed chunk that carries text (or the finish reason) − request start.
* E2E latency: last streamed chunk (with a choice) − request start.
* TPOT: per request with more than one output token, (latency − TTFT) / (output_tokens − 1).
* ITL: every gap between consecutive streamed chunks from the first token on, pooled over requests
  (with speculative decoding one chunk can carry several tokens; TPOT is then the per-token figure).
* Throughputs: completed requests, output tokens, input + output tokens, each / benchmark duration.
* Speculative decoding, from counter deltas over the run: acceptance rate = accepted / draft tokens,
  mean acceptance length = 1 + accepted / drafts, per-position rate = accepted at position i /
  drafts verified at position i (tpspec, whose k varies) or / drafts (vLLM), mean k = drafts
  proposed per request-step (tpspec's ``spec_decode_num_speculative_tokens`` histogram), draft
  bytes per draft token = bytes of the ``draft.sample`` collectives / draft tokens.

A figure with no data (no successful request, no request with 2+ tokens, a server without the
counters) is ``None``, never 0, so that a comparison cannot divide by it by mistake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

# Counter families, without the ``_total`` sample suffix; tpspec's names mirror vLLM's.
METRIC_PREFIXES = ("tpspec:", "vllm:")
NUM_DRAFTS = "spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
NUM_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
NUM_DRAFT_TOKENS_PER_POS = "spec_decode_num_draft_tokens_per_pos"
NUM_SPECULATIVE_TOKENS = "tpspec:spec_decode_num_speculative_tokens"  # histogram: _sum, _count
COMM_BYTES = "tpspec:comm_bytes"
DRAFT_SAMPLE_SITE = "draft.sample"

# {(sample name, sorted labels): value} of one /metrics scrape.
MetricsSnapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class RequestRecord:
    """One benchmark request as the client saw it; times are ``time.perf_counter()`` seconds."""

    start: float
    chunk_times: tuple[float, ...] = ()  # arrival of each streamed chunk, from the first token's on
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""  # the streamed text, joined

    def __post_init__(self) -> None:
        if self.success and not self.chunk_times:
            raise ValueError("RequestRecord.chunk_times must hold at least the first token's arrival "
                             "for a successful request")
        times = (self.start, *self.chunk_times)
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError(f"RequestRecord.chunk_times must be non-decreasing and not before "
                             f"start={self.start}, got {self.chunk_times}")
        for name in ("prompt_tokens", "output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"RequestRecord.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class SpecDecodeDelta:
    """Speculative-decoding counters accumulated over one run (after − before)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    num_accepted_per_pos: tuple[float, ...] = ()
    draft_sample_bytes: float | None = None  # None: the server does not count draft.sample traffic
    num_drafted_per_pos: tuple[float, ...] = ()  # () where the server does not count them
    # Drafts proposed and request-steps (the k histogram's sum and count); None: not exposed.
    num_speculative_tokens_sum: float | None = None
    num_speculative_tokens_count: float | None = None


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    std_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    std_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    std_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    std_e2el_ms: float | None
    p99_e2el_ms: float | None
    spec_decode_num_drafts: float | None = None
    spec_decode_num_draft_tokens: float | None = None
    spec_decode_num_accepted_tokens: float | None = None
    spec_decode_acceptance_rate: float | None = None  # accepted / draft tokens, 0..1
    spec_decode_acceptance_length: float | None = None  # 1 + accepted / drafts
    spec_decode_per_position_acceptance_rate: tuple[float, ...] | None = None
    spec_decode_mean_num_speculative_tokens: float | None = None  # mean k per request-step
    draft_bytes_per_draft_token: float | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["spec_decode_per_position_acceptance_rate"] is not None:
            d["spec_decode_per_position_acceptance_rate"] = list(d["spec_decode_per_position_acceptance_rate"])
        return d


def _stats_ms(values_s: Sequence[float]) -> tuple[float | None, float | None, float | None, float | None]:
    """(mean, median, std, p99) in ms; all None without values. Percentiles interpolate linearly."""
    if not values_s:
        return None, None, None, None
    a = np.asarray(values_s, dtype=np.float64) * 1000.0  # [n]
    return float(a.mean()), float(np.median(a)), float(a.std()), float(np.percentile(a, 99))


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, spec: SpecDecodeDelta | None = None
) -> BenchmarkMetrics:
    """The benchmark's figures from its requests and its wall time (``duration_s`` > 0)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ttft = _stats_ms([r.ttft for r in ok])
    tpot = _stats_ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = _stats_ms([gap for r in ok for gap in r.itl])
    e2el = _stats_ms([r.latency for r in ok])
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], std_ttft_ms=ttft[2], p99_ttft_ms=ttft[3],
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], std_tpot_ms=tpot[2], p99_tpot_ms=tpot[3],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], std_itl_ms=itl[2], p99_itl_ms=itl[3],
        mean_e2el_ms=e2el[0], median_e2el_ms=e2el[1], std_e2el_ms=e2el[2], p99_e2el_ms=e2el[3],
        **_spec_figures(spec),
    )


def _spec_figures(spec: SpecDecodeDelta | None) -> dict:
    if spec is None:
        return {}
    drafts, tokens, accepted = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
    return dict(
        spec_decode_num_drafts=drafts,
        spec_decode_num_draft_tokens=tokens,
        spec_decode_num_accepted_tokens=accepted,
        spec_decode_acceptance_rate=accepted / tokens if tokens > 0 else None,
        spec_decode_acceptance_length=1.0 + accepted / drafts if drafts > 0 else None,
        spec_decode_per_position_acceptance_rate=_per_position_rates(spec),
        spec_decode_mean_num_speculative_tokens=(
            spec.num_speculative_tokens_sum / spec.num_speculative_tokens_count
            if spec.num_speculative_tokens_count else None
        ),
        draft_bytes_per_draft_token=(
            spec.draft_sample_bytes / tokens if spec.draft_sample_bytes is not None and tokens > 0 else None
        ),
    )


def _per_position_rates(spec: SpecDecodeDelta) -> tuple[float, ...] | None:
    if not spec.num_accepted_per_pos or spec.num_drafts <= 0:
        return None
    if spec.num_drafted_per_pos:
        return tuple(a / d if d > 0 else 0.0 for a, d in zip(spec.num_accepted_per_pos, spec.num_drafted_per_pos))
    return tuple(a / spec.num_drafts for a in spec.num_accepted_per_pos)


# ---- /metrics --------------------------------------------------------------------------------------
def parse_metrics(text: str) -> MetricsSnapshot:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out: MetricsSnapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(snapshot: MetricsSnapshot, family: str, **labels: str) -> float | None:
    """Sum of a counter family's samples (``_total`` or bare name) whose labels include ``labels``;
    None if the family has no such sample."""
    names = (family + "_total", family)
    wanted = set(labels.items())
    found = [v for (name, lbls), v in snapshot.items() if name in names and wanted <= set(lbls)]
    return sum(found) if found else None


def _per_pos(snapshot: MetricsSnapshot, family: str) -> dict[int, float]:
    names = (family + "_total", family)
    out: dict[int, float] = {}
    for (name, lbls), v in snapshot.items():
        pos = dict(lbls).get("position")
        if name in names and pos is not None and pos.isdigit():
            out[int(pos)] = out.get(int(pos), 0.0) + v
    return out


def spec_decode_delta(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> SpecDecodeDelta | None:
    """The speculative-decoding counters' growth between two scrapes; None when the server does not
    expose them (no speculation, another server) or a scrape is missing."""
    if before is None or after is None:
        return None
    for prefix in METRIC_PREFIXES:
        counts = []
        for family in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS):
            a = _sum(after, prefix + family)
            counts.append(None if a is None else a - (_sum(before, prefix + family) or 0.0))
        if None in counts:
            continue
        per_pos = _per_pos_delta(before, after, prefix + NUM_ACCEPTED_PER_POS)
        drafted = _per_pos_delta(before, after, prefix + NUM_DRAFT_TOKENS_PER_POS)
        bytes_after = _sum(after, COMM_BYTES, site=DRAFT_SAMPLE_SITE)
        bytes_before = _sum(before, COMM_BYTES, site=DRAFT_SAMPLE_SITE) or 0.0
        draft_bytes = None if bytes_after is None else bytes_after - bytes_before
        k_sum, k_count = (_delta(before, after, NUM_SPECULATIVE_TOKENS + suffix) for suffix in ("_sum", "_count"))
        return SpecDecodeDelta(*counts, num_accepted_per_pos=per_pos, num_drafted_per_pos=drafted,
                               draft_sample_bytes=draft_bytes, num_speculative_tokens_sum=k_sum,
                               num_speculative_tokens_count=k_count)
    return None


def prefix_cache_delta(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, float] | None:
    """The prefix-cache counters' growth between two scrapes (``prefix_cache_queries`` and
    ``prefix_cache_hits``, in tokens, as tpspec and vLLM name them) and the hit rate; None when the
    server does not expose them or a scrape is missing."""
    if before is None or after is None:
        return None
    for prefix in METRIC_PREFIXES:
        queries, hits = (_sum(after, prefix + name) for name in ("prefix_cache_queries", "prefix_cache_hits"))
        if queries is None or hits is None:
            continue
        queries -= _sum(before, prefix + "prefix_cache_queries") or 0.0
        hits -= _sum(before, prefix + "prefix_cache_hits") or 0.0
        return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else None}
    return None


def _per_pos_delta(before: MetricsSnapshot, after: MetricsSnapshot, family: str) -> tuple[float, ...]:
    pos_after, pos_before = _per_pos(after, family), _per_pos(before, family)
    return tuple(pos_after.get(i, 0.0) - pos_before.get(i, 0.0) for i in range(max(pos_after, default=-1) + 1))


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, sample: str) -> float | None:
    """Growth of one unlabelled-but-for-model sample (e.g. a histogram's ``_sum``); None if absent."""
    a = _sum(after, sample)
    return None if a is None else a - (_sum(before, sample) or 0.0)
