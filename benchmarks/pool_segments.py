"""Pool the per-segment ratios of several ``bench_speculative.py`` runs: for each concurrency and
each adaptive configuration, the geometric mean of its throughput over another configuration's
on the same prompts seconds apart, with a 95% bootstrap interval (resampled segments).

One run gives a handful of segments per concurrency and this machine's speed drifts by 10-30 %
within minutes, so a 5 % difference is only resolved, if at all, by pooling runs.

  python3 benchmarks/pool_segments.py benchmarks/results/speculative_tp1_run7.json benchmarks/results/speculative_tp1_run8.json
"""

from __future__ import annotations

import argparse
import json
import math
import random

BOOTSTRAP_SAMPLES = 2000


def paired_ratios(runs: list[dict], num: str, den: str, c: int) -> list[float]:
    """Segment-by-segment throughput ratios num / den at concurrency c, over every run that has both."""
    out = []
    for run in runs:
        seg = {(r["config"], r["concurrency"]): r["segment_tok_s"] for r in run["results"]}
        if (num, c) in seg and (den, c) in seg:
            out += [a / b for a, b in zip(seg[(num, c)], seg[(den, c)])]
    return out


def geomean_interval(ratios: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean and its 95% bootstrap interval."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    boots = sorted(sum(rng.choice(logs) for _ in logs) / len(logs) for _ in range(BOOTSTRAP_SAMPLES))
    lo, hi = boots[int(0.025 * BOOTSTRAP_SAMPLES)], boots[int(0.975 * BOOTSTRAP_SAMPLES) - 1]
    return math.exp(sum(logs) / len(logs)), math.exp(lo), math.exp(hi)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="result files of bench_speculative.py")
    args = p.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            runs.append(json.load(f))
    configs = list(dict.fromkeys(r["config"] for run in runs for r in run["results"]))
    levels = sorted({r["concurrency"] for run in runs for r in run["results"]})
    print("| c | Adaptive | Over | Geometric mean (95% interval) | Segments |")
    print("|---|---|---|---|---|")
    for c in levels:
        for adaptive in (n for n in configs if n.endswith("-adaptive")):
            method = adaptive[: -len("-adaptive")]
            for other in ["plain"] + [n for n in configs if n.startswith(method + "-k")]:
                ratios = paired_ratios(runs, adaptive, other, c)
                if ratios:
                    g, lo, hi = geomean_interval(ratios)
                    print(f"| {c} | {adaptive} | {other} | {g:.3f} ({lo:.3f}–{hi:.3f}) | {len(ratios)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
