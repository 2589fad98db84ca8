"""Speculation length on held-out HumanEval: plain decoding, fixed k and the adaptive controller,
per method, concurrency and TP size (default model, greedy unless ``--temperature``, 128 tokens;
``--stop-at-eos``: up to 128).

Every configuration runs in its own process, started once (one at a time, so that no start-up
profile is measured beside another process's work) and kept alive: the coordinator then hands
the same prompts to each configuration in turn, one segment at a time (``--segment-prompts``,
default c prompts), in an order that alternates between segments (forward, then backward), so
only one process works at any moment and every configuration meets the machine's slow changes
of speed as often as the others; plain decoding comes first and the adaptive configurations
next, so that their ratios to plain are taken seconds apart. These machines are noisy (the same configuration varies by
10-30 % between runs minutes apart); a ratio between two configurations measured seconds apart
is far steadier than one between runs minutes apart.

Within a segment at most c requests are in flight (a new one starts when one ends);
``--num-prompts`` (default: max(8, 3c)) HumanEval prompts from index ``--first-prompt`` on (the
shipped drafter never trained on HumanEval; its trainer evaluates on the first 32) per level,
``--repeats`` times over. Figures, as ``vllm bench serve`` defines them: output throughput =
output tokens / wall time; TPOT per request = (finish − first token) / (output tokens − 1), the
mean over requests; acceptance length = 1 + accepted / drafts; mean k = chosen k per
request-step (``num_speculative_tokens_histogram``); mean step = wall time / engine steps. Each
figure is also given as a ratio to plain decoding at the same concurrency, with the median and
range of the per-segment ratios (each segment against plain decoding's run of the same prompts,
seconds apart); every run's greedy tokens are compared with plain decoding's.

How far two processes running the same thing differ is itself large here: with ``--twin``, a
second plain-decoding configuration (``plain-twin``, a configuration like any other) shows the
method's noise floor in the same table. With ``--one-process`` (TP 1 only: a process holds at
most one TP group), every configuration's engine lives in one process instead, so the
configurations share the allocator, the threads and the memory placement. Beside a twin on this
machine (benchmarks/README.md, run 12) both methods still spread widely per segment (the twin's
ratio 0.82–1.08 in one process, 0.80–1.18 in separate ones): the machine's drift dominates.

  python3 benchmarks/bench_speculative.py --tp 1 --result-file benchmarks/results/speculative_tp1.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from tpspec.bench.machine import machine_info


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
    p.add_argument("--extra-config", action="append", default=[], metavar="NAME=JSON",
                   help="one more configuration, e.g. a drafter from elsewhere: "
                        "'new-adaptive={\"method\": \"eagle3\", \"model\": \"/path\", \"num_speculative_tokens\": 6}'")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="per concurrency level (default max(8, 3c))")
    p.add_argument("--segment-prompts", type=int, default=None, help="prompts per segment (default c)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end a request at its end-of-sequence token, as a client does (default: always --max-tokens; "
                        "the text past it is unlike any drafter's training data and drafts there are rarely accepted)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (above 0 no run's tokens can be compared with plain decoding's)")
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="passes over each level's prompts")
    p.add_argument("--result-file", default=None)
    p.add_argument("--twin", action="store_true", help="add plain-twin, a second plain decoding: the noise floor")
    p.add_argument("--one-process", action="store_true", help="every configuration in one process (TP 1 only)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # {name: spec}: these configurations, in this process
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
    return {
        "tokens": [tokens[r] for r in ids],
        "tpots": [(done[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1],
        "wall_s": wall,
        "num_steps": engine.get_stats()["num_steps"] - steps0,
    }


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_delta(before: dict, after: dict) -> dict:
    if "num_drafts" not in after:
        return {}
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["k_histogram"] = [a - b for a, b in zip(after["num_speculative_tokens_histogram"],
                                              before["num_speculative_tokens_histogram"])]
    old = before["num_accepted_tokens_per_pos"]
    d["accepted_per_pos"] = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    return d


def worker(args) -> None:
    """Some configurations (``--worker``: {name: spec}): load each, one after the other, say
    READY, then run each segment asked for on standard input (``{"config": name, "concurrency":
    c, "start": i, "end": j}``, prompts i … j − 1) and print its result."""
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    specs = json.loads(args.worker)
    n = max(num_prompts(args, c) for c in args.concurrency)
    prompts = humaneval_prompts(args.first_prompt + n)[args.first_prompt :]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    engines = {}
    try:
        for name, spec in specs.items():
            engines[name] = LLMEngine.from_args(
                tensor_parallel_size=args.tp, speculative_config=spec, max_num_seqs=max(64, *args.concurrency)
            )
            run_level(engines[name], prompts[:1], 1, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        print("READY", flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            engine = engines[job["config"]]
            before = engine.get_stats()
            res = run_level(engine, prompts[job["start"] : job["end"]], job["concurrency"], params)
            res.update(spec_delta(before, engine.get_stats()))
            print("RESULT " + json.dumps(res), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()


class Process:
    """A process running some configurations (``worker``), kept alive between segments."""

    def __init__(self, args, specs: dict[str, dict | None]):
        self.names = ", ".join(specs)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(specs), "--tp", str(args.tp),
               "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature), "--first-prompt", str(args.first_prompt),
               "--concurrency", *map(str, args.concurrency)]
        if args.stop_at_eos:
            cmd.append("--stop-at-eos")
        if args.num_prompts:
            cmd += ["--num-prompts", str(args.num_prompts)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise SystemExit(f"the process of {self.names} exited with {self.proc.wait()} (its log is above)")

    def run(self, name: str, concurrency: int, start: int, end: int) -> dict:
        self.proc.stdin.write(json.dumps({"config": name, "concurrency": concurrency, "start": start, "end": end}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    if args.one_process and args.tp != 1:
        raise SystemExit("--one-process needs --tp 1: a process holds at most one TP group")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    machine = machine_info()
    todo = configs(args.methods, args.ks)
    if args.configs:
        todo = {name: todo[name] for name in args.configs}
    for extra in args.extra_config:
        name, _, spec = extra.partition("=")
        todo[name] = json.loads(spec)
    # Plain decoding first, then the adaptive configurations: run next to plain in every segment
    # (forward and backward), their ratios to it are the least exposed to the machine's drift.
    # The twin next: its ratio to plain is taken as far apart as the adaptive configurations' are.
    twin = {"plain-twin": None} if args.twin else {}
    todo = {"plain": None, **{n: s for n, s in todo.items() if n.endswith("-adaptive")}, **twin,
            **{n: s for n, s in todo.items() if n != "plain" and not n.endswith("-adaptive")}}
    processes, run_in = [], {}  # run_in: the process of each configuration
    try:
        if args.one_process:
            logger.info("starting one process for %s", ", ".join(todo))
            processes.append(Process(args, todo))
            run_in = dict.fromkeys(todo, processes[0])
        else:
            for name, spec in todo.items():  # one at a time: no start-up profile beside another process's work
                logger.info("starting %s: %s", name, spec)
                processes.append(Process(args, {name: spec}))
                run_in[name] = processes[-1]
        names = list(todo)
        segments = []  # [(segment result per config name, concurrency)]
        for c in args.concurrency:
            size = args.segment_prompts or c
            n = num_prompts(args, c)
            for _ in range(args.repeats):
                for start in range(0, n, size):
                    order = names if len(segments) % 2 == 0 else names[::-1]
                    seg = {name: run_in[name].run(name, c, start, min(n, start + size)) for name in order}
                    segments.append((seg, c))
                    logger.info("c=%d, prompts %d-%d: %s", c, start, min(n, start + size) - 1, ", ".join(
                        f"{name} {sum(map(len, r['tokens'])) / r['wall_s']:.1f}" for name, r in seg.items()))
                if args.result_file:  # after every pass: a run cut short keeps what it measured
                    save(args, machine, todo, summarize(segments, todo, args.temperature == 0))
    finally:
        for p in processes:
            p.close()
    results = summarize(segments, todo, args.temperature == 0)
    if args.result_file:
        save(args, machine, todo, results)
    print(format_table(results, args.tp))
    return 0


def summarize(segments: list[tuple[dict, int]], todo: dict, greedy: bool = True) -> list[dict]:
    """Per configuration and concurrency: the figures over all its segments, and the ratios to
    plain decoding overall and per segment; ``greedy``: whether tokens can be compared with plain's."""
    out = []
    for c in dict.fromkeys(c for _, c in segments):
        segs = [s for s, sc in segments if sc == c]
        for name in todo:
            runs = [s[name] for s in segs]
            tokens = sum(sum(map(len, r["tokens"])) for r in runs)
            wall = sum(r["wall_s"] for r in runs)
            tpots = [t for r in runs for t in r["tpots"]]
            steps = sum(r["num_steps"] for r in runs)
            res = {"config": name, "speculative_config": todo[name], "concurrency": c, "num_segments": len(runs),
                   "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
                   "mean_tpot_ms": 1000 * sum(tpots) / len(tpots), "num_steps": steps, "mean_step_ms": 1000 * wall / steps,
                   "segment_tok_s": [sum(map(len, r["tokens"])) / r["wall_s"] for r in runs]}
            if "num_drafts" in runs[0]:
                d = {k: sum(r[k] for r in runs) for k in SPEC_COUNTERS}
                hist = [sum(col) for col in zip(*(r["k_histogram"] for r in runs))]
                per_pos = [sum(r["accepted_per_pos"][i] for r in runs if i < len(r["accepted_per_pos"]))
                           for i in range(max(len(r["accepted_per_pos"]) for r in runs))]
                res.update(
                    # the share of drafting steps whose draft i + 1 was accepted
                    position_acceptance=[a / d["num_drafts"] for a in per_pos] if d["num_drafts"] else None,
                    acceptance_length=1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None,
                    acceptance_rate=d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
                    mean_k=sum(k * n for k, n in enumerate(hist)) / sum(hist) if sum(hist) else None,
                    k_histogram=hist,
                )
            res["greedy_equal_to_plain"] = (None if not greedy else
                                            sum(a == b for s in segs for a, b in zip(s[name]["tokens"], s["plain"]["tokens"])))
            res["num_requests"] = sum(len(r["tokens"]) for r in runs)
            out.append(res)
        base = next(r for r in out if r["config"] == "plain" and r["concurrency"] == c)
        for r in out:
            if r["concurrency"] == c:
                r["throughput_vs_plain"] = r["output_tok_s"] / base["output_tok_s"]
                r["segment_throughput_vs_plain"] = [a / b for a, b in zip(r["segment_tok_s"], base["segment_tok_s"])]
                r["tpot_speedup_vs_plain"] = base["mean_tpot_ms"] / r["mean_tpot_ms"]
                r["step_cost_vs_plain"] = r["mean_step_ms"] / base["mean_step_ms"]
    return out


def save(args, machine: dict, todo: dict, results: list[dict]) -> None:
    with open(args.result_file, "w") as f:
        json.dump({"machine": machine, "tp": args.tp, "one_process": args.one_process,
                   "max_tokens": args.max_tokens, "stop_at_eos": args.stop_at_eos, "temperature": args.temperature, "repeats": args.repeats,
                   "segment_prompts": args.segment_prompts, "configs": todo,
                   "prompts": f"HumanEval from index {args.first_prompt}", "results": results}, f, indent=1)


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _median_range(values: list[float], fmt: str) -> str:
    """The median of ``values`` and, in brackets, their range."""
    values = sorted(values)
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return format(median, fmt) + (f" ({format(values[0], fmt)}–{format(values[-1], fmt)})" if n > 1 else "")


def format_table(results: list[dict], tp: int) -> str:
    """One row per configuration and concurrency; × plain: overall, then the median and range of
    the per-segment ratios."""
    lines = [f"TP {tp}", "| Config | c | Output tok/s | × plain | × plain per segment | Mean TPOT (ms) | TPOT × plain "
             "| Mean step × plain | Acceptance length | Mean k | Greedy = plain |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['throughput_vs_plain']:.2f} "
            f"| {_median_range(r['segment_throughput_vs_plain'], '.2f')} | {r['mean_tpot_ms']:.1f} "
            f"| {r['tpot_speedup_vs_plain']:.2f} | {r['step_cost_vs_plain']:.2f} | {_f(r.get('acceptance_length'), '.2f')} "
            f"| {_f(r.get('mean_k'), '.2f')} | {_f(r['greedy_equal_to_plain'], 'd')}/{r['num_requests']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
