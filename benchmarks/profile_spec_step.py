"""Where a speculative step's time goes: per engine step on rank 0 (TP 1), the target's forward
(with the hidden-state capture a drafter reads), its LM head, verification, the drafter
(``_propose``: context writes, drafting pass and the LM head it borrows) and the rest (sampling,
host work), as medians over the steps of each number of verified drafts; beside plain decoding
of the same prompts.

Plain decoding and the speculative configuration run as two engines in one process (one process
per concurrency), taking turns: each of ``--rounds`` rounds sends c HumanEval prompts (from index
``--first-prompt``, new ones each round) through both, the order reversed every other round, so
that the machine's drift (up to 1.5x within minutes on these machines) falls on both alike. The c
prompts of a round start together, greedy, ``--max-tokens`` each; only steps in which all c
requests decode (no prefill, none finished yet) count, pooled over the rounds.

With ``--flowing N``, N prompts instead (one round: each engine's in turn), at most c in flight
(a finished request is replaced, as when serving), and every step counts: a second table gives, per kind of step (with or without
prefill rows, proposing drafts or not), the number of steps, their mean and maximum and their
total seconds, so that the whole run's difference between two configurations can be placed.

  python3 benchmarks/profile_spec_step.py --concurrency 1 8 --result-file benchmarks/results/profile_spec_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

from tpspec.bench.machine import machine_info


PHASES = ("forward", "logits", "verify", "propose")  # "logits": the target's LM head outside the drafter


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--speculative-config", default='{"method": "dflash", "num_speculative_tokens": 15}')
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop-at-eos", action="store_true", help="end a request at its end-of-sequence token (with --flowing)")
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--flowing", type=int, default=None, metavar="N",
                   help="N prompts with at most c in flight, every step counted by kind (see above)")
    p.add_argument("--result-file", default=None)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of c prompts, each through both engines in turn (the order reversed every other round)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "[specs]|c": one run, in this process
    return p.parse_args(argv)


class Recorder:
    """One engine (TP 1: its runner in this process) with timers on its runner's phases; its steps'
    phase times kept by verified drafts (steps in which all c requests decode) and by kind."""

    def __init__(self, spec: dict | None, c: int):
        from tpspec.engine.llm_engine import LLMEngine

        self.spec, self.c = spec, c
        self.engine = LLMEngine.from_args(speculative_config=spec, max_num_seqs=max(64, c))
        runner = self.engine.executor.runner
        self.current: dict[str, float] = {}
        self.by_verified: dict[int, list[dict]] = defaultdict(list)
        self.by_kind: dict[str, list[float]] = defaultdict(list)  # every step's seconds, by step_kind
        self._timed(runner.model, "forward", "forward")
        self._timed(runner.model, "compute_logits", "logits")
        self._timed(runner, "_verify", "verify")
        self._timed(runner, "_propose", "propose")
        execute = runner.execute

        def execute_timed(step):
            self.current.clear()
            t0 = time.perf_counter()
            out = execute(step)
            self.current["total"] = time.perf_counter() - t0
            if len(step.seqs) == c and all(s.num_new_tokens == 1 for s in step.seqs):
                self.by_verified[sum(s.num_spec for s in step.seqs)].append(dict(self.current))
            self.by_kind[step_kind(step)].append(self.current["total"])
            return out

        runner.execute = execute_timed

    def _timed(self, obj, name: str, phase: str) -> None:
        fn, current = getattr(obj, name), self.current

        def wrapper(*a, **kw):
            if phase == "logits" and "in_propose" in current:  # the drafter's: counted in "propose"
                return fn(*a, **kw)
            if phase == "propose":
                current["in_propose"] = 1.0
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            current[phase] = current.get(phase, 0.0) + time.perf_counter() - t0
            current.pop("in_propose", None)
            return out

        setattr(obj, name, wrapper)

    def run(self, prompts: list[str], params) -> None:
        """``prompts`` through the engine, at most c in flight (a finished request is replaced)."""
        engine, pending = self.engine, list(prompts)
        while pending or engine.has_unfinished_requests():
            while pending and engine.get_stats()["num_running"] + engine.get_stats()["num_waiting"] < self.c:
                engine.add_request(pending.pop(0), params)
            engine.step()

    def result(self) -> dict:
        rows = []
        for verified, steps in sorted(self.by_verified.items()):
            med = {k: 1000 * statistics.median(s.get(k, 0.0) for s in steps) for k in (*PHASES, "total")}
            med["other"] = med["total"] - sum(med[k] for k in PHASES)
            rows.append({"verified_drafts": verified, "steps": len(steps), "ms": med})
        kinds = {kind: {"steps": len(t), "mean_ms": 1000 * statistics.fmean(t), "max_ms": 1000 * max(t), "total_s": sum(t)}
                 for kind, t in sorted(self.by_kind.items())}
        return {"speculative_config": self.spec, "concurrency": self.c, "rows": rows, "kinds": kinds}


def worker(args) -> None:
    """Every configuration's engine in this process; the rounds' prompts through each in turn."""
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.sampling_params import SamplingParams

    specs_json, c = args.worker.rsplit("|", 1)
    specs, c = json.loads(specs_json), int(c)
    n = args.flowing or c
    rounds = 1 if args.flowing else args.rounds
    prompts = humaneval_prompts(args.first_prompt + rounds * n)[args.first_prompt :]
    recorders = [Recorder(spec, c) for spec in specs]
    try:
        for r in recorders:  # warm-up, not counted
            r.run(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
            r.by_verified.clear()
            r.by_kind.clear()
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
        for i in range(rounds):  # the configurations' order reversed every other round
            for r in recorders if i % 2 == 0 else recorders[::-1]:
                r.run(prompts[i * n : (i + 1) * n], params)
    finally:
        for r in recorders:
            r.engine.shutdown()
    for r in recorders:
        print("RESULT " + json.dumps(r.result()), flush=True)


def step_kind(step) -> str:
    """The step's kind: "prefill" if any request feeds more than one real token, else "decode";
    with " + drafts" if any request proposes drafts for its next step."""
    kind = "prefill" if any(s.num_new_tokens > 1 for s in step.seqs) else "decode"
    return kind + (" + drafts" if any(s.num_draft for s in step.seqs) else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    results = []
    specs = json.dumps([None, json.loads(args.speculative_config)])
    for c in args.concurrency:  # a fresh process for each concurrency, both configurations in it
        cmd = [sys.executable, __file__, "--worker", f"{specs}|{c}", "--max-tokens", str(args.max_tokens),
               "--first-prompt", str(args.first_prompt), "--rounds", str(args.rounds)]
        cmd += ["--flowing", str(args.flowing)] if args.flowing else []
        cmd += ["--stop-at-eos"] if args.stop_at_eos else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-4000:])
        results += [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    print("| Config | c | Verified drafts | Steps | Forward | LM head | Verify | Drafter | Other | Total (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        name = "plain" if r["speculative_config"] is None else r["speculative_config"]["method"]
        for row in r["rows"]:
            m = row["ms"]
            print(f"| {name} | {r['concurrency']} | {row['verified_drafts']} | {row['steps']} | {m['forward']:.1f} "
                  f"| {m['logits']:.1f} | {m['verify']:.1f} | {m['propose']:.1f} | {m['other']:.1f} | {m['total']:.1f} |")
    if args.flowing:
        print("\n| Config | c | Step kind | Steps | Mean (ms) | Max (ms) | Total (s) |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            name = "plain" if r["speculative_config"] is None else r["speculative_config"]["method"]
            for kind, k in r["kinds"].items():
                print(f"| {name} | {r['concurrency']} | {kind} | {k['steps']} | {k['mean_ms']:.1f} | {k['max_ms']:.1f} "
                      f"| {k['total_s']:.2f} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "max_tokens": args.max_tokens, "stop_at_eos": args.stop_at_eos, "flowing": args.flowing,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
