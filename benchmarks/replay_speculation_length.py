"""Replay the speculation-length controller on recorded greedy outputs: n-gram speculation
without the machine's noise.

Greedy n-gram speculation is deterministic given the tokens: the drafts a request holds at any
position are a lookup in its own earlier tokens, and how many of them verification accepts is
how many agree with the greedy continuation that plain decoding produced. So once the greedy
outputs of a set of prompts are recorded, with the step-time model that a real engine measured
and corrected while serving them, a policy for k (fixed k, the per-batch-size schedule, or the
adaptive controller itself, the engine's own class) can be replayed step by step in a simulated
engine whose step takes what the recorded model says. The replay answers "is this the best
allocation of drafts under these costs" in seconds, and the same figures measured on the
machine (``bench_speculative.py``) answer whether the costs are right.

  # once: greedy outputs and the measured step-time model at each concurrency (minutes)
  python3 benchmarks/replay_speculation_length.py record --out benchmarks/results/replay_trace.json
  # then, as often as wanted (seconds)
  python3 benchmarks/replay_speculation_length.py replay --trace benchmarks/results/replay_trace.json

The simulated engine keeps c requests running (a finished one is replaced), gives each new request
its prompt in one prefill row block, and counts a step's time as the recorded model's prediction
for its rows (target forward, overhead; n-gram has no drafter), optionally with multiplicative
log-normal noise (``--noise``) that the adaptive controller sees too.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time

logger = logging.getLogger("replay_speculation_length")


# ---- recording ------------------------------------------------------------------------------------
def record(args) -> None:
    """Greedy outputs of the prompts, and the step-time model an n-gram adaptive engine ends
    each concurrency level with (one engine, levels in turn)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_speculative import run_level

    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.bench.machine import machine_info
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    n = max(max(8, 3 * c) for c in args.concurrency)
    prompts = humaneval_prompts(args.first_prompt + n)[args.first_prompt:]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.max_k}
    engine = LLMEngine.from_args(speculative_config=spec, max_num_seqs=max(64, *args.concurrency))
    out = {"machine": machine_info(), "max_tokens": args.max_tokens, "max_k": args.max_k,
           "prompts": f"HumanEval from index {args.first_prompt}", "levels": {}}
    try:
        prompt_ids = [engine.tokenizer.encode(p) for p in prompts]
        for c in args.concurrency:
            m = max(8, 3 * c)
            res = run_level(engine, prompts[:m], c, params)
            tok_s = sum(map(len, res["tokens"])) / res["wall_s"]
            out["levels"][str(c)] = {"num_prompts": m, "output_tok_s": tok_s,
                                     "step_time_model": engine.get_stats()["step_time_model"]}
            logger.info("c=%d: %.1f tok/s", c, tok_s)
            if len(res["tokens"]) == n:
                out["sequences"] = [{"prompt": p, "output": o} for p, o in zip(prompt_ids, res["tokens"])]
    finally:
        engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(out, f)


# ---- replaying ------------------------------------------------------------------------------------
class SimRequest:
    def __init__(self, req_id: str, prompt: list[int], output: list[int]):
        self.req_id, self.prompt, self.output = req_id, prompt, output
        self.emitted = 0  # output tokens so far
        self.prefilled = False
        self.drafts: list[int] = []

    @property
    def remaining(self) -> int:
        return len(self.output) - self.emitted


def step_time_model(d: dict):
    """A ``StepTimeModel`` as its ``as_dict`` recorded it."""
    from tpspec.engine.speculation.step_time import PiecewiseLinear, StepTimeModel

    model = StepTimeModel("ngram", PiecewiseLinear(d["rows_grid"], d["rows_s"]), PiecewiseLinear(d["seqs_grid"], d["seqs_s"]),
                          PiecewiseLinear(d["rows_grid"], d["feed_s"]), PiecewiseLinear(d["rows_grid"], d["draft_pass_s"]))
    model.verify_jump = PiecewiseLinear([1], [d["verify_jump_s"]])
    model.overhead = d["overhead_s"]
    return model


def replay(trace: dict, level: str, spec_dict: dict | None, noise: float, seed: int) -> dict:
    """One policy at one concurrency: simulated output tokens per second and what it chose."""
    from tpspec.config import SpeculativeConfig
    from tpspec.engine.speculation.controller import PlanRequest, SpeculationLengthController
    from tpspec.spec_decode.ngram import NgramProposer

    c = int(level)
    seqs = trace["sequences"][: trace["levels"][level]["num_prompts"]]
    truth = step_time_model(trace["levels"][level]["step_time_model"])
    rng = random.Random(seed)
    controller = ngram = None
    if spec_dict is not None:
        spec = SpeculativeConfig.from_dict({"method": "ngram", **spec_dict})
        controller = SpeculationLengthController(
            spec, step_time_model(trace["levels"][level]["step_time_model"]) if spec.adaptive else None)
        ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
    pending = [SimRequest(f"r{i}", s["prompt"], s["output"]) for i, s in enumerate(seqs)]
    running: list[SimRequest] = []
    clock, steps, drafted, accepted_total, tokens_total = 0.0, 0, 0, 0, 0
    while pending or running:
        while pending and len(running) < c:
            running.append(pending.pop(0))
        real_rows = sum(1 if r.prefilled else len(r.prompt) for r in running)
        if controller is not None:
            reqs = [PlanRequest(r.req_id, True, len(r.drafts), max(0, r.remaining - 1),
                                max(0, min(controller.max_k, r.remaining - 2))) for r in running]
            plan = controller.plan(reqs, real_rows)
            verify, propose = plan.num_verify, plan.num_propose
        else:
            verify, propose = [0] * len(running), [0] * len(running)
        target_rows = real_rows + sum(verify)
        decode_only = target_rows == len(running) and all(r.prefilled for r in running)
        step_s = truth.predict(target_rows, len(running), real_rows, propose, decode_only)
        if noise:
            step_s *= math.exp(rng.gauss(0.0, noise))
        accepted = []
        for r, v in zip(running, verify):
            truth_next = r.output[r.emitted:r.emitted + v]
            a = 0
            while a < v and r.drafts[a] == truth_next[a]:
                a += 1
            accepted.append(a)
            r.emitted = min(len(r.output), r.emitted + a + 1)
            r.prefilled = True
            drafted += v
            accepted_total += a
        if controller is not None:
            for r, v, a in zip(running, verify, accepted):
                controller.observe_verification(r.req_id, v, a)
            controller.observe_step(plan, reqs, step_s, 0.0, 0, step_s)  # n-gram: no drafter rows
        for r, k in zip(running, propose):
            r.drafts = ngram.propose(r.prompt + r.output[:r.emitted], k) if k and r.remaining > 1 else []
        clock += step_s
        steps += 1
        done = [r for r in running if r.remaining == 0]
        for r in done:
            tokens_total += len(r.output)
            if controller is not None:
                controller.forget(r.req_id)
        running = [r for r in running if r.remaining > 0]
    out = {"output_tok_s": tokens_total / clock, "steps": steps, "drafted": drafted,
           "accepted_per_draft": accepted_total / drafted if drafted else None}
    if controller is not None:
        out["mean_k"] = controller.as_dict()["mean_num_speculative_tokens"]
    return out


def policies(max_k: int, ks: list[int]) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"plain": None}
    for k in ks:
        out[f"ngram-k{k}"] = {"num_speculative_tokens": k, "adaptive": False}
    out["ngram-adaptive"] = {"num_speculative_tokens": max_k}
    return out


def replay_all(args) -> None:
    with open(args.trace) as f:
        trace = json.load(f)
    print("| c | Policy | Simulated tok/s | × plain | × best fixed | Accepted per draft | Mean k |")
    print("|---|---|---|---|---|---|---|")
    for level in trace["levels"]:
        if args.concurrency and int(level) not in args.concurrency:
            continue
        t0 = time.perf_counter()
        rows = {}
        for name, spec in policies(trace["max_k"], args.ks).items():
            runs = [replay(trace, level, spec, args.noise, seed) for seed in range(args.seeds)]
            rows[name] = {key: (sum(r[key] for r in runs) / len(runs) if runs[0].get(key) is not None else None)
                          for key in runs[0]}
        best = max(v["output_tok_s"] for k, v in rows.items() if k.startswith("ngram-k"))
        plain = rows["plain"]["output_tok_s"]
        for name, r in rows.items():
            apd = "-" if r.get("accepted_per_draft") is None else f"{r['accepted_per_draft']:.2f}"
            mk = "-" if r.get("mean_k") is None else f"{r['mean_k']:.2f}"
            print(f"| {level} | {name} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / plain:.2f} "
                  f"| {r['output_tok_s'] / best:.2f} | {apd} | {mk} |")
        logger.info("c=%s replayed in %.1f s", level, time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", required=True)
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--max-k", type=int, default=15)
    r.add_argument("--first-prompt", type=int, default=64)
    s = sub.add_parser("replay")
    s.add_argument("--trace", required=True)
    s.add_argument("--concurrency", type=int, nargs="+", default=None)
    s.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 7, 15])
    s.add_argument("--noise", type=float, default=0.0, help="log-normal sigma of each simulated step's time")
    s.add_argument("--seeds", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.cmd == "record":
        record(args)
    else:
        replay_all(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
