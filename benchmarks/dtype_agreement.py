"""How far a cheaper setting's greedy output strays from float32's: dtype and kernel accuracy.

Generates ``--max-tokens`` greedy tokens for ``--num-prompts`` held-out HumanEval prompts with the
default model (or ``--model``) in float32 with a float32 KV cache (the reference) and in each setting (each in a
fresh process): a dtype, or ``float32+fp16`` (float32 with ``--quantization fp16``; ``float32+q4_1``
likewise), with ``@KV`` the KV cache's dtype (``float32+w4a16@float16``; without it the engine's
default, ``auto``), and
reports per setting: the sequences identical to float32's, the mean number of tokens before the
first difference, and on the tokens both agree on, the largest and mean absolute difference of
the chosen token's log-probability against float32's (a logit error in nats).

  python3 benchmarks/dtype_agreement.py --settings float32+fp16 float16 bfloat16 --result-file benchmarks/results/dtype_agreement.json
  python3 benchmarks/dtype_agreement.py --settings float32+q4_1 float32+fp16 --max-num-seqs 1
  python3 benchmarks/dtype_agreement.py --settings float32@float16 float32+w4a16@float32 float32+w4a16@float16

``--max-num-seqs 1`` decodes one sequence at a time in every setting (the prompts' order), as a
single stream is served: ``q4_1``'s kernel takes products of up to 8 rows, so its numerics differ
between one sequence and many.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

from tpspec.bench.datasets import humaneval_prompts
from tpspec.bench.machine import machine_info


def _generate(setting: str, torch_compile: bool, prompts: list[str], max_tokens: int, max_num_seqs: int | None,
              model: str | None, queue) -> None:
    from tpspec import LLM, SamplingParams

    setting, _, kv = setting.partition("@")  # no @: the engine's default KV cache dtype
    dtype, _, quantization = setting.partition("+")  # float32 alone: unquantized
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    options = ({} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}) | ({"kv_cache_dtype": kv} if kv else {})
    with LLM(model, dtype=dtype, quantization=quantization or "none", torch_compile=torch_compile, **options) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    queue.put([(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]) for o in outs])


def run(setting: str, torch_compile: bool, prompts: list[str], max_tokens: int, max_num_seqs: int | None = None,
        model: str | None = None):
    """Tokens and chosen-token logprobs of every prompt, from a fresh process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_generate, args=(setting, torch_compile, prompts, max_tokens, max_num_seqs, model, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def compare(ref, other) -> dict:
    identical, prefix, diffs = 0, [], []
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, other):
        first = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ref_ids))
        identical += first == len(ref_ids)
        prefix.append(first)
        diffs += [abs(a - b) for a, b in zip(ref_lp[:first], lp[:first])]
    return {
        "identical": identical,
        "sequences": len(ref),
        "mean_tokens_before_first_difference": sum(prefix) / len(prefix),
        "max_abs_logprob_diff": max(diffs, default=0.0),
        "mean_abs_logprob_diff": sum(diffs) / max(1, len(diffs)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", nargs="+", default=["float32+fp16"],
                   help="compared with float32: a dtype, or DTYPE+QUANTIZATION (float32+fp16), @KV_CACHE_DTYPE after either")
    p.add_argument("--torch-compile", action="store_true", help="compile the compared settings' decode steps")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences decoded together, in every setting (default: the engine's; 1: one at a time)")
    p.add_argument("--model", default=None, help="model folder/name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--result-file")
    args = p.parse_args(argv)
    prompts = humaneval_prompts(args.num_prompts)
    ref = run("float32@float32", False, prompts, args.max_tokens, args.max_num_seqs, args.model)
    rows = {}
    batch = "" if args.max_num_seqs is None else f", at most {args.max_num_seqs} sequences a step"
    print(f"{args.num_prompts} HumanEval prompts, {args.max_tokens} greedy tokens each{batch}, against float32 with a float32 KV cache (eager)")
    print("| Setting | Identical sequences | Mean tokens before first difference | Max / mean abs logprob diff |")
    print("|---|---|---|---|")
    for setting in args.settings:
        name = setting + (" compiled" if args.torch_compile else "")
        r = rows[name] = compare(ref, run(setting, args.torch_compile, prompts, args.max_tokens, args.max_num_seqs, args.model))
        print(f"| {name} | {r['identical']}/{r['sequences']} | {r['mean_tokens_before_first_difference']:.1f} | "
              f"{r['max_abs_logprob_diff']:.4f} / {r['mean_abs_logprob_diff']:.5f} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
