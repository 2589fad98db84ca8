"""What rounding a drafter's own weights to Q4_1 (``--quantization q4_1``, the default on CPUs with
the kernels; ``spec_decode.drafter_rounding.round_drafter_to_q4_1``) costs in acceptance: the same held-out
HumanEval prompts drafted by the head as shipped (its bfloat16 weights, multiplied in float16)
and rounded, each in a fresh process, greedy, fixed k, every request in one batch (acceptance
does not depend on timing). Reports the mean acceptance length and the acceptance per draft position.

  python3 benchmarks/draft_weight_rounding.py --method eagle3 --k 3 --num-prompts 32 --result-file out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tpspec.bench.machine import machine_info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="eagle3")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--first-prompt", type=int, default=64, help="the shipped drafters' trainers evaluate on the first 32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--result-file", default=None)
    p.add_argument("--worker", choices=["shipped", "rounded"], default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams
    from tpspec.worker import model_runner

    if args.worker == "shipped":  # the drafter's weights as loaded (packed in float16)
        model_runner.round_drafter_to_q4_1 = lambda drafter, target: 0
    engine = LLMEngine.from_args(
        speculative_config={"method": args.method, "num_speculative_tokens": args.k, "adaptive": False},
        quantization="q4_1",
    )
    prompts = humaneval_prompts(args.first_prompt + args.num_prompts)[args.first_prompt :]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [list(o.outputs[0].token_ids) for o in engine.step() if o.finished]
    print(json.dumps({"stats": engine.spec_stats.as_dict(), "tokens": sorted(outputs)}))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = {}
    for variant in ("shipped", "rounded"):
        cmd = [sys.executable, __file__, "--worker", variant, "--method", args.method, "--k", str(args.k),
               "--num-prompts", str(args.num_prompts), "--first-prompt", str(args.first_prompt),
               "--max-tokens", str(args.max_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(out)
    print("| Drafter weights | Acceptance length | Acceptance per position |")
    print("|---|---|---|")
    for variant, r in results.items():
        s = r["stats"]
        per_pos = [a / max(1, d) for a, d in zip(s["num_accepted_tokens_per_pos"], s["num_draft_tokens_per_pos"])]
        print(f"| {variant} | {s['mean_acceptance_length']:.3f} | {', '.join(f'{p:.3f}' for p in per_pos)} |")
    same = results["shipped"]["tokens"] == results["rounded"]["tokens"]
    print(f"greedy outputs identical: {same}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": {v: r["stats"] for v, r in results.items()}, "outputs_identical": same}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
