"""Speculation length on held-out HumanEval: plain decoding, fixed k and the adaptive controller,
per method, concurrency and TP size (default model, greedy, 128 tokens).

For every configuration a fresh process runs one engine (TP ``--tp``) through each
``--concurrency`` level in turn: at most c requests in flight (a new one starts when one ends),
``--num-prompts`` (default: max(8, 3c)) HumanEval prompts from index ``--first-prompt`` on (the
shipped drafter never trained on HumanEval; its trainer evaluates on the first 32), after one
warm-up request. Figures, as ``vllm bench serve`` defines them: output throughput = output tokens
/ wall time; TPOT per request = (finish − first token) / (output tokens − 1), the mean over
requests; acceptance length = 1 + accepted / drafts; mean k = drafts proposed per request-step
(``num_speculative_tokens_histogram``); mean step = wall time / engine steps. Each figure is also
given as a ratio to plain decoding at the same concurrency in the same run, and every run's
greedy tokens are compared with plain decoding's.

These machines are noisy (the same configuration varies by 10-30 % between runs), so
``--repeats N`` runs every configuration N times, in rounds that alternate the order (ABBA:
forward, then backward), and compares each run with plain decoding of its own round; the table
gives the median over rounds and the range of each ratio.

  python3 benchmarks/bench_speculative.py --tp 1 --repeats 2 --result-file benchmarks/results/speculative_tp1.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from machine import machine_info

logger = logging.getLogger("bench_speculative")


def configs(methods: list[str], ks: list[int]) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"plain": None}
    for method in methods:
        for k in ks:
            out[f"{method}-k{k}"] = {"method": method, "num_speculative_tokens": k, "adaptive": False}
        out[f"{method}-adaptive"] = {"method": method, "num_speculative_tokens": max(ks)}
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=["dflash", "ngram"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7, 15], help="fixed k; the adaptive runs use max")
    p.add_argument("--configs", nargs="+", default=None, help="only these (names as printed); default all")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="per concurrency level (default max(8, 3c))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds over every configuration, in alternating order")
    p.add_argument("--result-file", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    return p.parse_args(argv)


def num_prompts(args, c: int) -> int:
    """Three waves of c requests by default: requests start and end at different times, as when
    serving, rather than all at once."""
    return args.num_prompts or max(8, 3 * c)


def run_level(engine, prompts: list[str], concurrency: int, params) -> dict:
    """Keep ``concurrency`` requests in flight until every prompt is done."""
    pending, first, done, tokens = list(prompts), {}, {}, {}
    steps0 = engine.get_stats()["num_steps"]
    t0 = time.perf_counter()
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            engine.add_request(pending.pop(0), params)
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id], tokens[o.request_id] = now, list(o.outputs[0].token_ids)
                in_flight -= 1
    wall = time.perf_counter() - t0
    ids = sorted(tokens, key=lambda r: int(r.split("-")[1]))
    tpots = [(done[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    steps = engine.get_stats()["num_steps"] - steps0
    return {
        "tokens": [tokens[r] for r in ids],
        "output_tokens": sum(len(tokens[r]) for r in ids),
        "wall_s": wall,
        "output_tok_s": sum(len(tokens[r]) for r in ids) / wall,
        "mean_tpot_ms": 1000 * sum(tpots) / len(tpots),
        "num_steps": steps,
        "mean_step_ms": 1000 * wall / steps,
    }


def spec_delta(before: dict, after: dict) -> dict:
    if "num_drafts" not in after:
        return {}
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    hist = [a - b for a, b in zip(after["num_speculative_tokens_histogram"], before["num_speculative_tokens_histogram"])]
    n = sum(hist)
    return {
        "acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None,
        "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
        "mean_k": sum(k * c for k, c in enumerate(hist)) / n if n else None,
        "k_histogram": hist,
    }


def worker(args) -> None:
    """Run one configuration through every concurrency level; print one JSON line per level."""
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    spec = json.loads(args.worker)
    n = max(num_prompts(args, c) for c in args.concurrency)
    prompts = humaneval_prompts(args.first_prompt + n)[args.first_prompt :]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = LLMEngine.from_args(tensor_parallel_size=args.tp, speculative_config=spec, max_num_seqs=max(64, *args.concurrency))
    try:
        for c in args.concurrency:
            run_level(engine, prompts[:1], 1, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
            before = engine.get_stats()
            res = run_level(engine, prompts[: num_prompts(args, c)], c, params)
            res.update(concurrency=c, **spec_delta(before, engine.get_stats()))
            print("RESULT " + json.dumps(res), flush=True)
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    machine = machine_info()
    todo = configs(args.methods, args.ks)
    if args.configs:
        todo = {name: todo[name] for name in args.configs}
    results = []
    for round_ in range(args.repeats):
        names = list(todo) if round_ % 2 == 0 else list(reversed(todo))
        for name in names:
            results += run_config(args, name, todo[name], round_)
            compare_with_plain(results)
            if args.result_file:  # after every configuration: a run cut short keeps what it measured
                save(args, machine, results)
    print(format_table(results, args.tp))
    return 0


def compare_with_plain(results: list[dict]) -> None:
    """Each result's ratios to plain decoding at its concurrency in its round."""
    for r in results:
        base = next((b for b in results if b["config"] == "plain" and b["round"] == r["round"]
                     and b["concurrency"] == r["concurrency"]), None)
        if base is not None:
            r["throughput_vs_plain"] = r["output_tok_s"] / base["output_tok_s"]
            r["tpot_speedup_vs_plain"] = base["mean_tpot_ms"] / r["mean_tpot_ms"]
            r["step_cost_vs_plain"] = r["mean_step_ms"] / base["mean_step_ms"]
            r["greedy_equal_to_plain"] = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))


def save(args, machine: dict, results: list[dict]) -> None:
    with open(args.result_file, "w") as f:
        json.dump({"machine": machine, "tp": args.tp, "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "prompts": f"HumanEval from index {args.first_prompt}",
                   "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}, f, indent=1)


def run_config(args, name: str, spec: dict | None, round_: int) -> list[dict]:
    """One configuration through every concurrency level, in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), "--tp", str(args.tp),
           "--max-tokens", str(args.max_tokens), "--first-prompt", str(args.first_prompt),
           "--concurrency", *map(str, args.concurrency)]
    if args.num_prompts:
        cmd += ["--num-prompts", str(args.num_prompts)]
    logger.info("round %d, %s: %s", round_, name, spec)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    results = []
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results.append({"config": name, "speculative_config": spec, "round": round_, **r})
            logger.info("%s c=%d: %.1f tok/s, TPOT %.1f ms, acceptance %s, mean k %s", name, r["concurrency"],
                        r["output_tok_s"], r["mean_tpot_ms"], r.get("acceptance_length"), r.get("mean_k"))
    return results


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _median_range(values: list, fmt: str) -> str:
    """The median of ``values``, with their range when there are several."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return format(median, fmt) + (f" ({format(values[0], fmt)}–{format(values[-1], fmt)})" if n > 1 else "")


def format_table(results: list[dict], tp: int) -> str:
    """One row per configuration and concurrency: medians over rounds (ranges in brackets)."""
    lines = [f"TP {tp}", "| Config | c | Output tok/s | × plain | Mean TPOT (ms) | TPOT × plain | Mean step × plain "
             "| Acceptance length | Mean k | Greedy = plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["concurrency"], r["config"]) for r in results}, key=lambda k: (k[0], list(dict.fromkeys(
        r["config"] for r in results)).index(k[1])))
    for c, name in keys:
        rs = [r for r in results if r["concurrency"] == c and r["config"] == name]
        col = lambda key, fmt: _median_range([r.get(key) for r in rs], fmt)  # noqa: E731
        equal = sum(r.get("greedy_equal_to_plain", 0) for r in rs)
        total = sum(len(r["tokens"]) for r in rs)
        lines.append(
            f"| {name} | {c} | {col('output_tok_s', '.1f')} | {col('throughput_vs_plain', '.2f')} "
            f"| {col('mean_tpot_ms', '.1f')} | {col('tpot_speedup_vs_plain', '.2f')} | {col('step_cost_vs_plain', '.2f')} "
            f"| {col('acceptance_length', '.2f')} | {col('mean_k', '.2f')} | {equal}/{total} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
