"""How much of a constrained output the grammar alone decides: at each position of the greedy
outputs of ``bench_structured.py``'s JSON-schema workload (default model), whether the mask allows
exactly one token (a forced token: it could be verified as a free draft, no drafter needed), and
the text the grammar forces from there (xgrammar's ``find_jump_forward_string``: what a
jump-forward that retokenizes forced text could add; counted once per forced stretch).

  python3 benchmarks/forced_tokens.py --result-file benchmarks/results/forced_tokens.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_structured  # noqa: E402

from tpspec.bench.machine import machine_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--result-file")
    args = ap.parse_args()
    from tpspec import LLM, SamplingParams
    from tpspec.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=bench_structured.SCHEMA)
    prompts = bench_structured.prompts(None, args.num_prompts)
    with LLM() as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, structured_outputs=so), use_tqdm=False)
        compiler = llm.llm_engine._grammar
        compiler_tokenizer = llm.llm_engine.tokenizer
    total = forced = chars = jump_chars = 0
    runs: list[int] = []
    for out in outs:
        matcher = compiler.matcher(so)
        row = torch.empty(1, -(-compiler.vocab_size // 32), dtype=torch.int32)
        run = 0
        chars += len(out.outputs[0].text)
        reach = 0  # output characters already covered by an earlier forced stretch
        done = 0
        for t in out.outputs[0].token_ids:
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(row, 0)
            allowed = sum(bin(w & 0xFFFFFFFF).count("1") for w in row[0].tolist())
            total += 1
            if allowed == 1:
                forced += 1
                run += 1
            elif run:
                runs.append(run)
                run = 0
            if done >= reach:
                jump = len(matcher.find_jump_forward_string())
                jump_chars += jump
                reach = done + jump
            done += len(compiler_tokenizer.decode([t], skip_special_tokens=False))
            matcher.accept_token(t)
        if run:
            runs.append(run)
    result = {"machine": machine_info(), "outputs": len(outs), "tokens": total, "forced": forced,
              "forced_share": forced / total, "output_chars": chars, "jump_forward_chars": jump_chars,
              "jump_forward_share": jump_chars / max(1, chars), "mean_forced_run": sum(runs) / max(1, len(runs)), "forced_runs": len(runs)}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
