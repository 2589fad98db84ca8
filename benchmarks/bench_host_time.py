"""Host time of a decode step: what an engine step costs beyond the model's own work.

c HumanEval prompts (from index ``--first-prompt``) start together, greedy, ``--max-tokens`` each
(EOS ignored), plain decoding or ``--speculative-config``, TP 1 (the runner lives in this
process). Only steps in which all c requests decode count (the prefill and the tail are left
out). Per step: the whole ``LLMEngine.step`` (scheduler, executor, runner, outputs), the target's
forward and its LM head (``compute_logits`` / ``compute_logits_shard``); host = step − forward −
LM head: building inputs, sampling metadata, verification bookkeeping, the driver's scheduling
and output handling. Medians over the counted steps, and over ``--repeats`` passes.

  python3 benchmarks/bench_host_time.py --concurrency 1 32 --result-file benchmarks/results/host_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpspec.bench.datasets import humaneval_prompts
from tpspec.bench.machine import machine_info


def measure(concurrency: int, args) -> dict:
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = LLMEngine.from_args(speculative_config=spec, max_num_seqs=max(64, concurrency))
    runner = engine.executor.runner  # TP 1: the runner lives in this process
    current: dict[str, float] = {}

    def timed(obj, name: str, phase: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            current[phase] = current.get(phase, 0.0) + time.perf_counter() - t0
            return out

        setattr(obj, name, wrapper)

    model = runner.model
    timed(model, "forward", "forward")
    timed(model, "compute_logits", "lm_head")
    timed(model, "compute_logits_shard", "lm_head")
    prompts = humaneval_prompts(args.first_prompt + concurrency)[args.first_prompt :]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    steps: list[dict[str, float]] = []
    try:
        for _ in range(args.repeats):
            for p in prompts:
                engine.add_request(p, params)
            while engine.has_unfinished_requests():
                stats = engine.get_stats()
                decoding = stats["num_running"] == concurrency and stats["num_waiting"] == 0
                current.clear()
                t0 = time.perf_counter()
                outs = engine.step()
                total = time.perf_counter() - t0
                prefill = any(len(o.outputs[0].token_ids) <= 1 for o in outs)
                if decoding and not prefill and not any(o.finished for o in outs):
                    steps.append(dict(current, step=total))
    finally:
        engine.shutdown()
    med = {k: 1000 * statistics.median(s.get(k, 0.0) for s in steps) for k in ("step", "forward", "lm_head")}
    host = [1000 * (s["step"] - s.get("forward", 0.0) - s.get("lm_head", 0.0)) for s in steps]
    med["host"] = statistics.median(host)
    med["host_p10"], med["host_p90"] = (statistics.quantiles(host, n=10)[i] for i in (0, -1))
    return {"concurrency": concurrency, "steps": len(steps), "ms": med}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    results = [measure(c, args) for c in args.concurrency]
    for r in results:
        ms = r["ms"]
        print(f"c={r['concurrency']:>3}  steps {r['steps']:>4}  step {ms['step']:7.2f} ms  forward {ms['forward']:7.2f}  "
              f"lm_head {ms['lm_head']:6.2f}  host {ms['host']:6.2f} (p10 {ms['host_p10']:.2f}, p90 {ms['host_p90']:.2f})")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
