"""Decode steps alone: output tokens per second once every request has been prefilled.

Submits the first ``--batch`` HumanEval prompts at once (greedy, ``ignore_eos``, ``--max-tokens``
each), runs the first engine step (the prefill) untimed, then times every step to the end:
throughput = batch · decode steps / time, and the median step. ``bench_generate.py`` measures
whole requests, prefill included; this isolates the per-token path (attention, matmuls, sampling).

  python3 benchmarks/bench_decode_steps.py --tp 2 --dtype bfloat16 --batch 32 --result-file decode_steps.json

``--profile N`` runs N decode steps, after 3 unprofiled ones, under ``torch.profiler`` (TP 1: this
process's ops) and prints the ops that took the most time, self time first, by input shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpspec.bench.datasets import humaneval_prompts
from tpspec.bench.machine import machine_info
from tpspec.config import QUANTIZATION_OPTIONS
from tpspec.llm import LLM
from tpspec.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--torch-compile", action="store_true", help="compiled decode steps (EngineConfig.torch_compile)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_OPTIONS)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N decode steps (after 3)")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    llm = LLM(tensor_parallel_size=args.tp, dtype=args.dtype, torch_compile=args.torch_compile,
              quantization=args.quantization)
    llm.generate(humaneval_prompts()[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in humaneval_prompts()[: args.batch]:
        engine.add_request(prompt, params)
    engine.step()  # prefill (the whole batch fits one step's token budget by default)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            engine.step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.profile):
                engine.step()
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=90))
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    tok_s, median_ms = args.batch * len(steps) / elapsed, 1e3 * statistics.median(steps)
    compiled = ", compiled" if args.torch_compile else ""
    print(f"{args.dtype} ({args.quantization}) TP {args.tp}{compiled} batch {args.batch}: {len(steps)} decode steps, "
          f"{tok_s:.1f} tok/s, median step {median_ms:.1f} ms")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(dict(machine=machine_info(), args=vars(args), decode_steps=len(steps), output_tok_s=tok_s,
                           median_step_ms=median_ms, step_ms=[1e3 * s for s in steps]), f, indent=1)


if __name__ == "__main__":
    main()
