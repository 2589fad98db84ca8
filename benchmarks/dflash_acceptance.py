"""Held-out acceptance of DFlash drafters in the engine: greedy, fixed k, HumanEval prompts from
index 64 (the trainers evaluate on the first 32), 128 tokens each, every request in one batch
(acceptance does not depend on timing); each drafter in a fresh process.

  python3 benchmarks/dflash_acceptance.py --drafters shipped path/to/drafter --k 15 --result-file out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tpspec.bench.machine import machine_info


def worker(drafter: str, k: int, first: int, num: int, max_tokens: int) -> dict:
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    spec = {"method": "dflash", "num_speculative_tokens": k, "adaptive": False}
    if drafter != "shipped":
        spec["model"] = drafter
    engine = LLMEngine.from_args(speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in humaneval_prompts(first + num)[first:]:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.spec_stats.as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafters", nargs="+", default=["shipped"], help="'shipped' or drafter folders")
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--result-file", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.k, args.first_prompt, args.num_prompts, args.max_tokens)))
        return 0
    results = {}
    for drafter in args.drafters:
        cmd = [sys.executable, __file__, "--worker", drafter, "--k", str(args.k), "--first-prompt", str(args.first_prompt),
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
        results[drafter] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print("| Drafter | Acceptance length | Acceptance per position (first 4) |")
    print("|---|---|---|")
    for drafter, s in results.items():
        per_pos = [a / max(1, d) for a, d in zip(s["num_accepted_tokens_per_pos"], s["num_draft_tokens_per_pos"])]
        print(f"| {drafter} | {s['mean_acceptance_length']:.3f} | {', '.join(f'{x:.3f}' for x in per_pos[:4])} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
