"""Benchmark output: ``vllm bench serve``-style tables, the comparison table, JSON and a PNG chart."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

WIDTH = 50


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _section(title: str) -> str:
    return f"{title:-^{WIDTH}}"


def format_serve_table(r: dict[str, Any]) -> str:
    """The result of one ``bench serve`` run, laid out as vLLM prints it."""
    def row(label: str, value: Any, digits: int = 2) -> str:
        return f"{label:<40}{_fmt(value, digits):<10}"

    lines = [
        f"{' Serving Benchmark Result ':=^{WIDTH}}",
        row("Successful requests:", r["completed"]),
        row("Failed requests:", r["failed"]),
        row("Maximum request concurrency:", r.get("max_concurrency")),
        row("Request rate configured (RPS):", r.get("request_rate")),
        row("Benchmark duration (s):", r["duration_s"]),
        row("Total input tokens:", r["total_input_tokens"]),
        row("Total generated tokens:", r["total_output_tokens"]),
        row("Request throughput (req/s):", r["request_throughput"]),
        row("Output token throughput (tok/s):", r["output_throughput"]),
        row("Total token throughput (tok/s):", r["total_token_throughput"]),
    ]
    for key, title, name in (("ttft", "Time to First Token", "TTFT"),
                             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl", "Inter-token Latency", "ITL"),
                             ("e2el", "End-to-end Latency", "E2EL")):
        lines.append(_section(title))
        lines += [row(f"{stat.capitalize()} {name} (ms):", r[f"{stat}_{key}_ms"]) for stat in ("mean", "median")]
        lines.append(row(f"P99 {name} (ms):", r[f"p99_{key}_ms"]))
    if r.get("prefix_cache_queries") is not None:
        rate = r["prefix_cache_hit_rate"]
        lines += [
            _section("Prefix Cache"),
            row("Hit rate (%):", None if rate is None else 100 * rate),
            row("Queried tokens:", int(r["prefix_cache_queries"])),
            row("Hit tokens:", int(r["prefix_cache_hits"])),
        ]
    if r.get("spec_decode_num_drafts") is not None:
        rate = r["spec_decode_acceptance_rate"]
        per_pos = r["spec_decode_per_position_acceptance_rate"]
        lines += [
            _section("Speculative Decoding"),
            row("Acceptance rate (%):", None if rate is None else 100 * rate),
            row("Acceptance length:", r["spec_decode_acceptance_length"]),
            row("Drafts:", int(r["spec_decode_num_drafts"])),
            row("Draft tokens:", int(r["spec_decode_num_draft_tokens"])),
            row("Accepted tokens:", int(r["spec_decode_num_accepted_tokens"])),
            row("Mean drafts per request-step (k):", r.get("spec_decode_mean_num_speculative_tokens")),
            row("Draft bytes per draft token:", r["draft_bytes_per_draft_token"], 1),
        ]
        if per_pos:
            lines += ["Per-position acceptance (%):", "  " + ", ".join(f"{100 * p:.1f}" for p in per_pos)]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _change(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return ""
    return f"{100 * (value - base) / base:+.1f}%"


COMPARE_COLUMNS = (
    ("Output throughput (tok/s)", "output_throughput", 1),
    ("Mean TPOT (ms)", "mean_tpot_ms", 2),
    ("Acceptance length", "spec_decode_acceptance_length", 3),
    ("Draft bytes/token", "draft_bytes_per_draft_token", 1),
)


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (config, concurrency), in first-run order: each ``COMPARE_COLUMNS`` figure's
    mean over the rounds, and its range as ``<key>_min`` / ``<key>_max`` (None where a round lacks it)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["max_concurrency"]), []).append(r)
    rows = []
    for (config, concurrency), group in groups.items():
        row: dict[str, Any] = {"config": config, "max_concurrency": concurrency, "rounds": len(group)}
        for _, key, _ in COMPARE_COLUMNS:
            values = [r.get(key) for r in group]
            missing = None in values or any(not math.isfinite(v) for v in values)
            row[key] = None if missing else sum(values) / len(values)
            row[f"{key}_min"] = None if missing else min(values)
            row[f"{key}_max"] = None if missing else max(values)
        rows.append(row)
    return rows


def format_compare_table(summary: Sequence[dict[str, Any]], baseline: str) -> str:
    """A Markdown table of ``summarize``'s rows, every figure followed by its change against the
    ``baseline`` config's at the same concurrency. Over several rounds a figure is the mean with
    its range, and a change whose ranges overlap the baseline's is marked "within the spread"."""
    base = {r["max_concurrency"]: r for r in summary if r["config"] == baseline}
    header = ["Config", "Concurrency"] + [title for title, _, _ in COMPARE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in summary:
        ref = base.get(r["max_concurrency"], {})
        cells = [r["config"], str(r["max_concurrency"])]
        for _, key, digits in COMPARE_COLUMNS:
            cell = _fmt(r.get(key), digits)
            if r.get("rounds", 1) > 1 and r.get(key) is not None:
                cell += f" ({_fmt(r[f'{key}_min'], digits)}–{_fmt(r[f'{key}_max'], digits)})"
            change = "" if r is ref else _change(r.get(key), ref.get(key))
            if change and r.get("rounds", 1) > 1 and _overlap(r, ref, key):
                change += ", within the spread"
            cells.append(cell + (f" ({change})" if change else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _overlap(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    lo, hi = f"{key}_min", f"{key}_max"
    if any(r.get(k) is None for r in (a, b) for k in (lo, hi)):
        return False
    return a[lo] <= b[hi] and b[lo] <= a[hi]


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON; non-finite floats become null (strict JSON)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(obj), f, indent=2, allow_nan=False)
        f.write("\n")


def plot_comparison(runs: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Grouped bars (one group per concurrency, one bar per config) of output throughput and mean
    TPOT, saved as a PNG. Uses matplotlib's Agg canvas directly: no display, no global backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = list(dict.fromkeys(r["config"] for r in runs))
    levels = list(dict.fromkeys(r["max_concurrency"] for r in runs))
    by_key = {(r["config"], r["max_concurrency"]): r for r in runs}
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    width = 0.8 / len(configs)
    for ax, (label, key) in zip(fig.subplots(1, 2),
                                (("Output throughput (tok/s)", "output_throughput"), ("Mean TPOT (ms)", "mean_tpot_ms"))):
        for j, config in enumerate(configs):
            xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(levels))]
            ys = [by_key.get((config, c), {}).get(key) or 0.0 for c in levels]
            bars = ax.bar(xs, ys, width, label=config)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(levels)), [f"concurrency {c}" for c in levels])
        ax.set_title(label)
        ax.margins(y=0.12)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(configs))
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
