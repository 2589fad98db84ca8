"""Where a plain decode step's time goes (issue #42 item 1): products, attention, norms, the rest
of each module's own work (the attention module's: rotary and reshapes; the MLP's: its
activation; the decoder layer's: residual adds), embedding, LM head, sampling, and the host work
around them (scheduler, inputs, metadata, outputs), at concurrency 1 and 32.

c HumanEval prompts start together, greedy, EOS ignored, TP 1, the engine's defaults (or
``--quantization``); only steps
in which all c requests decode count. First ``--steps`` steps are timed as they are (the step's
wall time); then as many with a forward pre/post hook on every module of the target and timers
around ``compute_logits`` and ``ModelRunner._sample``, each region's time exclusive of the regions
inside it (so a module's own time excludes the modules it calls).
Host = step wall − (forward + LM head + sampling). The hooks add work of their own (a few µs per
module call); the hooked step's wall is reported beside the plain one so their cost shows. The
hooked steps run through the layers' modules (``use_layer_plans`` off: a plan calls the kernels
without them), the plain ones as the engine runs (through the plans where they apply).

  python3 benchmarks/profile_step.py --result-file benchmarks/results/profile_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from tpspec.bench.datasets import humaneval_prompts
from tpspec.bench.machine import machine_info
from tpspec.config import QUANTIZATION_OPTIONS

CATEGORIES = {  # module class -> category; any other module: its class name (its own time)
    "QKVParallelLinear": "products", "RowParallelLinear": "products", "MergedColumnParallelLinear": "products",
    "ColumnParallelLinear": "products", "ReplicatedLinear": "products",
    "Attention": "attention", "RMSNorm": "norms", "GemmaRMSNorm": "norms", "RotaryEmbedding": "rotary",
    "VocabParallelEmbedding": "embedding",
}


class ExclusiveTimer:
    """Exclusive wall time per category over nested regions (one thread)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [category, start, time spent in children]

    def enter(self, category: str) -> None:
        self.stack.append([category, time.perf_counter(), 0.0])

    def leave(self) -> None:
        category, start, children = self.stack.pop()
        spent = time.perf_counter() - start
        self.totals[category] += spent - children
        if self.stack:
            self.stack[-1][2] += spent


def measure(concurrency: int, args) -> dict:
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    engine = LLMEngine.from_args(max_num_seqs=max(64, concurrency), quantization=args.quantization)
    runner = engine.executor.runner  # TP 1: the runner lives in this process
    prompts = humaneval_prompts(concurrency)
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while len(engine.scheduler.running) < concurrency or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()

    plain = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)

    timer = ExclusiveTimer()
    handles = []
    runner.model.use_layer_plans = False  # every module called, so that its hooks time it
    for module in runner.model.modules():
        category = CATEGORIES.get(type(module).__name__, type(module).__name__)
        handles.append(module.register_forward_pre_hook(lambda m, a, c=category: timer.enter(c)))
        handles.append(module.register_forward_hook(lambda m, a, o: timer.leave()))

    def wrap(obj, name: str, category: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            timer.enter(category)
            try:
                return fn(*a, **kw)
            finally:
                timer.leave()
        setattr(obj, name, wrapper)

    wrap(runner.model, "compute_logits", "LM head")
    wrap(runner, "_sample", "sampling")
    hooked = []
    per_step: list[dict[str, float]] = []
    for _ in range(args.steps):
        timer.totals.clear()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        hooked.append(wall)
        step = dict(timer.totals)
        step["host"] = wall - sum(step.values())
        per_step.append(step)
    for h in handles:
        h.remove()
    engine.shutdown()
    categories = sorted({k for s in per_step for k in s})
    med = {k: 1000 * statistics.median(s.get(k, 0.0) for s in per_step) for k in categories}
    return {"concurrency": concurrency, "steps": args.steps, "plain_step_ms": 1000 * statistics.median(plain),
            "hooked_step_ms": 1000 * statistics.median(hooked), "breakdown_ms": med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_OPTIONS)
    p.add_argument("--result-file")
    args = p.parse_args()
    results = [measure(c, args) for c in args.concurrency]
    for r in results:
        total = sum(r["breakdown_ms"].values())
        print(f"c={r['concurrency']}: step {r['plain_step_ms']:.2f} ms plain, {r['hooked_step_ms']:.2f} ms hooked")
        for k, v in sorted(r["breakdown_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:<12} {v:7.2f} ms  {100 * v / total:5.1f} %")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
