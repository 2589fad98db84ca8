"""Held-out acceptance of drafters in the engine: fixed k, HumanEval prompts from index 64 (the
trainers evaluate on the first 32), 128 tokens each, every request in one batch (acceptance does not
depend on timing); each (drafter, k, temperature) in a fresh process. Per drafter: the mean
acceptance length and the acceptance rate at each draft position (accepted / proposed there).

  python3 benchmarks/drafter_acceptance.py --method eagle3 --ks 3 6 --temperatures 0 0.8 --result-file out.json
  python3 benchmarks/drafter_acceptance.py --method dflash --drafters shipped path/to/drafter --ks 15

With ``--write-acceptance`` each drafter folder given gets an ``acceptance.json`` (what the adaptive
controller starts from, ``speculative_config.acceptance_prior``): the greedy run's rate at each draft
position given the drafts before it accepted (of the largest k run), up to the last position that
at least ``MIN_TRIED`` accepted drafts reached.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tpspec.bench.machine import machine_info

MIN_TRIED = 40  # drafts a position's rate must rest on to be written (--write-acceptance)


def worker(method: str, drafter: str, k: int, temperature: float, first: int, num: int, max_tokens: int, seed: int) -> dict:
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams

    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if drafter != "shipped":
        spec["model"] = drafter
    engine = LLMEngine.from_args(speculative_config=spec, seed=seed)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    for prompt in humaneval_prompts(first + num)[first:]:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.spec_stats.as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="eagle3", help="the speculative method (eagle3, dflash, mtp)")
    p.add_argument("--drafters", nargs="+", default=["shipped"], help="'shipped' or drafter folders")
    p.add_argument("--ks", type=int, nargs="+", default=[3])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed (temperature > 0)")
    p.add_argument("--result-file", default=None)
    p.add_argument("--write-acceptance", action="store_true",
                   help="write each drafter folder's acceptance.json from its greedy run (see above)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "drafter|k|temperature": one run, here
    args = p.parse_args(argv)
    run = dict(first=args.first_prompt, num=args.num_prompts, max_tokens=args.max_tokens, seed=args.seed)
    if args.worker:
        drafter, k, temperature = args.worker.rsplit("|", 2)
        print(json.dumps(worker(args.method, drafter, int(k), float(temperature), **run)))
        return 0
    results = []
    for drafter in args.drafters:
        for k in args.ks:
            for temperature in args.temperatures:
                cmd = [sys.executable, __file__, "--worker", f"{drafter}|{k}|{temperature}", "--method", args.method,
                       "--first-prompt", str(args.first_prompt), "--num-prompts", str(args.num_prompts),
                       "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                results.append({"drafter": drafter, "k": k, "temperature": temperature,
                                "stats": json.loads(out.strip().splitlines()[-1])})
    print("| Drafter | k | Temperature | Acceptance length | Acceptance per position |")
    print("|---|---|---|---|---|")
    for r in results:
        s = r["stats"]
        per_pos = [a / max(1, d) for a, d in zip(s["num_accepted_tokens_per_pos"], s["num_draft_tokens_per_pos"])]
        print(f"| {r['drafter']} | {r['k']} | {r['temperature']:g} | {s['mean_acceptance_length']:.3f} | "
              f"{', '.join(f'{x:.3f}' for x in per_pos)} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    if args.write_acceptance:
        write_acceptance(results, " ".join(["python3", "benchmarks/drafter_acceptance.py", *(argv or sys.argv[1:])]))
    return 0


def conditional_rates(stats: dict) -> list[float]:
    """α_j = drafts accepted at position j over those accepted at j − 1 (position 1: over all
    drafting passes), while at least ``MIN_TRIED`` reached position j."""
    rates, reached = [], stats["num_drafts"]
    for accepted in stats["num_accepted_tokens_per_pos"]:
        if reached < MIN_TRIED:
            break
        rates.append(round(accepted / reached, 3))
        reached = accepted
    return rates


def write_acceptance(results: list[dict], command: str) -> None:
    """Each drafter folder's ``acceptance.json`` from its greedy run with the largest k."""
    from tpspec.spec_decode.resolve import ACCEPTANCE_FILE

    for drafter in dict.fromkeys(r["drafter"] for r in results):
        greedy = [r for r in results if r["drafter"] == drafter and r["temperature"] == 0.0]
        if drafter == "shipped" or not greedy:
            print(f"{drafter}: no {ACCEPTANCE_FILE} written (a folder and a greedy run are needed)")
            continue
        best = max(greedy, key=lambda r: r["k"])
        path = os.path.join(drafter, ACCEPTANCE_FILE)
        with open(path, "w") as f:
            json.dump({"greedy_acceptance_rates": conditional_rates(best["stats"]),
                       "measured_by": f"{command} (k = {best['k']}, {machine_info()['cpu']})"}, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
