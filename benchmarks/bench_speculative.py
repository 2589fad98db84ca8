"""Speculative decoding on held-out HumanEval prompts (issue #5): acceptance length per method and
k, and TPOT against no speculation at concurrency 1 and 32, default model, greedy.

For every configuration one engine runs (TP ``--tp``):
  concurrency 1    ``--num-c1`` prompts, one request at a time
  concurrency N    ``--concurrency`` prompts submitted at once
Per request, TPOT = (finish time − first-token time) / (output tokens − 1), the ``vllm bench
serve`` definition, timed around ``LLMEngine.step``; the mean over requests is reported.
Acceptance length = 1 + accepted / drafts over the whole run (bonus token included). Every
speculative run's greedy tokens are checked against the run without speculation.

  python3 benchmarks/bench_speculative.py --result-file benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time

import torch

from tpspec.bench.datasets import humaneval_prompts
from tpspec.engine.llm_engine import LLMEngine
from tpspec.sampling_params import SamplingParams

logger = logging.getLogger("bench_speculative")

CONFIGS = {
    "none": None,
    "dflash-k15": {"method": "dflash", "num_speculative_tokens": 15, "use_local_argmax_reduction": True},
    "dflash-k7": {"method": "dflash", "num_speculative_tokens": 7, "use_local_argmax_reduction": True},
    "dflash-k3": {"method": "dflash", "num_speculative_tokens": 3, "use_local_argmax_reduction": True},
    "ngram-k4": {"method": "ngram", "num_speculative_tokens": 4},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-c1", type=int, default=8, help="prompts run one at a time")
    p.add_argument("--concurrency", type=int, default=32, help="prompts submitted at once (0: skip)")
    p.add_argument("--first-prompt", type=int, default=64, help="index of the first HumanEval prompt used (the trainer evaluates on the first 32)")
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def run_batch(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list[dict]:
    """Submit all prompts, step until done; per request: tokens, TPOT (s)."""
    first, done, tokens = {}, {}, {}
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id], tokens[o.request_id] = now, list(o.outputs[0].token_ids)
    rows = []
    for rid in ids:
        n = len(tokens[rid])
        rows.append({"tokens": tokens[rid], "tpot_s": (done[rid] - first[rid]) / (n - 1) if n > 1 else None})
    return rows


def spec_figures(before: dict, after: dict) -> dict:
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    return {
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafts": drafts,
    }


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    n = max(args.num_c1, args.concurrency)
    prompts = humaneval_prompts(args.first_prompt + n)[args.first_prompt :]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results, reference = [], {}
    for name in args.configs:
        engine = LLMEngine.from_args(tensor_parallel_size=args.tp, speculative_config=CONFIGS[name], max_num_seqs=64)
        try:
            run_batch(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
            for conc, ps in (("1", prompts[: args.num_c1]), (str(args.concurrency), prompts[: args.concurrency])):
                if not ps:
                    continue
                before = engine.get_stats()
                t0 = time.perf_counter()
                rows = [r for p in ps for r in run_batch(engine, [p], params)] if conc == "1" else run_batch(engine, ps, params)
                wall = time.perf_counter() - t0
                toks = [r["tokens"] for r in rows]
                key = (conc, len(ps))
                if name == "none":
                    reference[key] = toks
                same = None if key not in reference else sum(a == b for a, b in zip(toks, reference[key]))
                res = {"config": name, "speculative_config": CONFIGS[name], "concurrency": int(conc),
                       "requests": len(ps), "output_tokens": sum(map(len, toks)), "wall_s": round(wall, 2),
                       "output_tok_s": sum(map(len, toks)) / wall, "mean_tpot_ms": 1000 * mean([r["tpot_s"] for r in rows]),
                       "greedy_equal_to_none": same, **spec_figures(before, engine.get_stats())}
                results.append(res)
                logger.info("%s", res)
        finally:
            engine.shutdown()
    base = {(r["concurrency"]): r["mean_tpot_ms"] for r in results if r["config"] == "none"}
    print("| Config | Concurrency | Acceptance length | Mean TPOT (ms) | TPOT speedup | Output tok/s | Greedy = none |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        al = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        speed = f"{base[r['concurrency']] / r['mean_tpot_ms']:.2f}x" if r["concurrency"] in base else "-"
        eq = "-" if r["greedy_equal_to_none"] is None else f"{r['greedy_equal_to_none']}/{r['requests']}"
        print(f"| {r['config']} | {r['concurrency']} | {al} | {r['mean_tpot_ms']:.1f} | {speed} | {r['output_tok_s']:.1f} | {eq} |")
    if args.result_file:
        meta = {"torch": torch.__version__, "machine": platform.machine(), "tp": args.tp, "max_tokens": args.max_tokens,
                "prompts": f"HumanEval[{args.first_prompt}:{args.first_prompt + n}]"}
        with open(args.result_file, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
