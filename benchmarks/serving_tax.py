"""The serving tax: one stream's decode time per token through ``tpspec serve`` (HTTP, streamed,
measured by ``tpspec bench serve`` at concurrency 1) against the offline engine (``LLM.generate``,
one request at a time), same prompts, same engine flags, each in a fresh process, one after the
other on an otherwise idle machine.

Offline TPOT per prompt = (time of a ``--max-tokens`` generate − time of a 1-token generate) /
(max_tokens − 1), so the prefill cancels (both after a first 1-token generate: with prefix caching
the full run finds the prompt's blocks cached, and so does the timed 1-token one); the served TPOT is ``bench serve``'s (latency − TTFT) /
(tokens − 1). Both skip one warm-up request. The client runs on the same machine as the server.

  python benchmarks/serving_tax.py --num-prompts 8 --max-tokens 64 --result-file benchmarks/results/serving_tax.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

from tpspec.bench.compare import ServerProcess
from tpspec.bench.machine import machine_info
from tpspec.bench.report import write_json
from tpspec.bench.serve import Target, Workload, benchmark

logger = logging.getLogger("serving_tax")


def offline_tpot_ms(num_prompts: int, max_tokens: int, engine_args: dict) -> list[float]:
    """In this process: one TPOT (ms) per HumanEval prompt after the warm-up one."""
    from tpspec import LLM, SamplingParams
    from tpspec.bench.datasets import humaneval_prompts

    prompts = humaneval_prompts(num_prompts + 1)
    one = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(**engine_args) as llm:
        llm.generate(prompts[0], full, use_tqdm=False)
        tpots = []
        for p in prompts[1:]:
            llm.generate(p, one, use_tqdm=False)  # the prompt's blocks cached, as the full run finds them
            t0 = time.perf_counter()
            llm.generate(p, one, use_tqdm=False)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(p, full, use_tqdm=False)
            tpots.append((time.perf_counter() - t0 - prefill) / (max_tokens - 1) * 1000)
    return tpots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine-args", default="{}", help='JSON LLM keywords, e.g. \'{"dtype": "float16"}\'')
    p.add_argument("--result-file", default="serving_tax.json")
    p.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    engine_args = json.loads(args.engine_args)
    if args.offline_child:
        print(json.dumps(offline_tpot_ms(args.num_prompts, args.max_tokens, engine_args)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    child = subprocess.run([sys.executable, __file__, "--offline-child", *sys.argv[1:]], check=True,
                           capture_output=True, text=True)
    offline = json.loads(child.stdout.strip().splitlines()[-1])
    flags = [x for k, v in engine_args.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    log = os.path.join(os.path.dirname(os.path.abspath(args.result_file)), "serving_tax.server.log")
    server = ServerProcess(flags, log)
    try:
        url = server.start(timeout_s=900)
        served = benchmark(Target(url), Workload(num_prompts=args.num_prompts, max_concurrency=1,
                                                 max_tokens=args.max_tokens, ignore_eos=True, num_warmups=1),
                           show_progress=False)
    finally:
        server.stop()
    off, on = statistics.mean(offline), served["mean_tpot_ms"]
    write_json(args.result_file, {"machine": machine_info(), "args": vars(args), "offline_tpot_ms": offline,
                                  "served": {k: v for k, v in served.items() if not isinstance(v, (list, dict))}})
    print(f"offline TPOT {off:.1f} ms (per prompt {', '.join(f'{x:.1f}' for x in offline)}); "
          f"served TPOT {on:.1f} ms; served / offline = {on / off:.3f}")


if __name__ == "__main__":
    main()
