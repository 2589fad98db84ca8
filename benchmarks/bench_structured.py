"""Structured outputs' cost: a JSON-schema workload against the same prompts unconstrained, plain
decoding and EAGLE-3 (adaptive), at concurrency 1 and 32, TP 1.

Chat prompts ask for a JSON object describing one of 64 things (name, category, year, tags);
constrained requests carry the schema of ``SCHEMA`` (``StructuredOutputsParams(json=...)``), the
unconstrained ones nothing; greedy. A constrained request ends when its object is complete (at
most ``--max-tokens`` tokens); its unconstrained twin generates exactly as many tokens (EOS
ignored), so both runs schedule the same steps and the difference is what the grammar costs per
token (its masks, and for EAGLE-3 what the grammar does to acceptance). Each engine configuration
runs in its own process, one at a time; within it, for each concurrency, the same prompts run
constrained, unconstrained, unconstrained, constrained (ABBA, seconds apart).
Figures per run: TPOT per request = (finish − first token) / (output tokens − 1), its mean;
output throughput = output tokens / wall time; for constrained runs the share of outputs that
parse and validate (``jsonschema``), and the time spent computing masks (xgrammar) per engine
step. Ratios: constrained / unconstrained TPOT, medians of the two pairs.

  python3 benchmarks/bench_structured.py --result-file benchmarks/results/structured_default.json
  python3 benchmarks/bench_structured.py --model gemma-3-270m --configs plain \\
      --result-file benchmarks/results/structured_gemma.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from tpspec.bench.machine import machine_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "category": {"enum": ["animal", "tool", "food", "place", "vehicle", "instrument", "plant", "other"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "category", "year", "tags"],
    "additionalProperties": False,
}
THINGS = ("cat bicycle violin apple Paris hammer oak lighthouse dolphin tram cello bread Tokyo wrench cactus canoe "
          "owl rice Lima saw fern glider tiger cheese Oslo drill rose yacht fox noodle Cairo chisel tulip rocket "
          "horse soup Rome pliers maple bus eagle mango Quito ladder lily truck whale plum Delhi axe moss kayak "
          "wolf pear Kyiv rake ivy barge bee lime Bern").split()
CONFIGS = {"plain": None, "eagle3-adaptive": {"method": "eagle3"}}


def prompts(model: str | None, n: int) -> list[list[int]]:
    from tpspec.models.loader.resolve import resolve_model
    from tpspec.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(resolve_model(model))
    out = []
    for thing in (THINGS * (n // len(THINGS) + 1))[:n]:
        q = (f"Describe {thing} as a JSON object with the fields name, category (animal, tool, food, place, vehicle, "
             "instrument, plant or other), year and a list of tags.")
        try:
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False))
        except ValueError:  # no chat template (Gemma 3 270M's GGUF): the question as a plain prompt
            out.append(tok.encode(q + "\n"))
    return out


def run_level(engine, batch: list[list[int]], concurrency: int, params: list) -> dict:
    """Keep ``concurrency`` requests in flight until every prompt is done (``params[i]``: prompt i's)."""
    pending, first, done, outs = list(zip(batch, params)), {}, {}, {}
    steps0 = engine.get_stats()["num_steps"]
    t0 = time.perf_counter()
    in_flight = 0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            engine.add_request(*pending.pop(0))
            in_flight += 1
        for o in engine.step():
            now = time.perf_counter()
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id], outs[o.request_id] = now, o.outputs[0]
                in_flight -= 1
    wall = time.perf_counter() - t0
    ids = sorted(outs, key=lambda r: int(r.split("-")[1]))
    lens = [len(outs[r].token_ids) for r in ids]
    return {
        "texts": [outs[r].text for r in ids],
        "lengths": lens,
        "tpot_ms": statistics.mean((done[r] - first[r]) / (n - 1) * 1e3 for r, n in zip(ids, lens) if n > 1),
        "throughput": sum(lens) / wall,
        "output_tokens": sum(lens),
        "num_steps": engine.get_stats()["num_steps"] - steps0,
    }


def valid_share(texts: list[str]) -> float:
    import jsonschema

    ok = 0
    for t in texts:
        try:
            jsonschema.validate(json.loads(t), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(texts)


def worker(args) -> None:
    """One configuration in this process: every concurrency level, ABBA."""
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.sampling_params import SamplingParams, StructuredOutputsParams
    from tpspec.structured import request_grammar

    mask_s = [0.0]
    fill = request_grammar.RequestGrammar._mask_now

    def timed_mask(self):
        t0 = time.perf_counter()
        try:
            return fill(self)
        finally:
            mask_s[0] += time.perf_counter() - t0

    request_grammar.RequestGrammar._mask_now = timed_mask
    spec = CONFIGS[args.worker]
    engine = LLMEngine.from_args(model=args.model, speculative_config=spec, max_num_seqs=64)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    all_prompts = prompts(args.model, max(args.num_prompts(c) for c in args.concurrency))
    run_level(engine, all_prompts[:2], 2, [constrained] * 2)  # warm-up (and the grammar compiled)
    results = []
    for c in args.concurrency:
        batch = all_prompts[: args.num_prompts(c)]
        runs = {"free": [], "json": []}
        free = None
        for kind in ("json", "free", "free", "json") * args.rounds:
            mask_s[0] = 0.0
            if kind == "json":
                res = run_level(engine, batch, c, [constrained] * len(batch))
                free = free or [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in res["lengths"]]
            else:
                res = run_level(engine, batch, c, free)
            res["mask_ms_per_step"] = mask_s[0] * 1e3 / max(1, res["num_steps"])
            if kind == "json":
                res["valid"] = valid_share(res["texts"])
            del res["texts"], res["lengths"]
            runs[kind].append(res)
            print(f"{args.worker:16s} c={c:<3d} {kind:5s} TPOT {res['tpot_ms']:7.2f} ms  {res['throughput']:7.1f} tok/s  "
                  f"masks {res['mask_ms_per_step']:.3f} ms/step" + (f"  valid {res['valid']:.0%}" if kind == "json" else ""),
                  flush=True, file=sys.stderr)
        # Each constrained run against the unconstrained run next to it (ABBA: json, free | free, json).
        ratios = [j["tpot_ms"] / f["tpot_ms"] for f, j in zip(runs["free"], runs["json"])]
        results.append({"config": args.worker, "concurrency": c, "runs": runs, "tpot_ratio": ratios})
    engine.shutdown()
    print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts-c1", type=int, default=8, help="prompts at concurrency 1 (2c at higher levels)")
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds per concurrency level")
    ap.add_argument("--result-file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.num_prompts = lambda c: args.prompts_c1 if c == 1 else 2 * c
    if args.worker:
        return worker(args)
    out = {"machine": machine_info(), "model": args.model or "default", "schema": SCHEMA, "results": []}
    for name in args.configs:  # one process per configuration, one at a time
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--max-tokens", str(args.max_tokens),
               "--prompts-c1", str(args.prompts_c1), "--rounds", str(args.rounds),
               "--concurrency", *map(str, args.concurrency)]
        if args.model:
            cmd += ["--model", args.model]
        line = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
        out["results"] += json.loads(line[len("RESULT "):])
    for r in out["results"]:
        f = statistics.median(x["tpot_ms"] for x in r["runs"]["free"])
        j = statistics.median(x["tpot_ms"] for x in r["runs"]["json"])
        print(f"{r['config']:16s} c={r['concurrency']:<3d} TPOT free {f:7.2f} ms  json {j:7.2f} ms  ratio "
              f"{statistics.median(r['tpot_ratio']):.3f} ({min(r['tpot_ratio']):.3f}-{max(r['tpot_ratio']):.3f})  "
              f"valid {min(x['valid'] for x in r['runs']['json']):.0%}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
