"""Offline generation throughput: tpspec (TP 1/2) beside transformers' ``generate``, same run.

Greedy decoding of HumanEval prompts, every request exactly ``--max-tokens`` new tokens
(tpspec: ``ignore_eos``; transformers: ``min_new_tokens``), measured as output tokens / second:
  batch 1       ``--num-batch1`` prompts, one request at a time (sum of the per-request times)
  concurrent    ``--concurrency`` prompts submitted at once (tpspec: one ``generate`` call;
                transformers: one left-padded batch, pad = EOS, with an attention mask)
Both systems get the same token ids. Each config is warmed up by one short generate first;
each tpspec config runs in a fresh process.
tpspec sets torch's thread count per rank (cores // TP), transformers gets all cores.
The batch-1 greedy tokens are checked against transformers' ("k/N equal"; a request whose
tpspec output contains EOS is compared up to it, as ``min_new_tokens`` suppresses EOS there).

  python3 benchmarks/bench_generate.py --tp 1 2 --dtype float32 bfloat16 --torch-compile off on --quantization none fp16 --result-file out.json
  python3 benchmarks/bench_generate.py --tp 1 --kv-cache-dtype float32 float16 float32 float16 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import time
import traceback

import torch
from tqdm import tqdm

from tpspec.bench.datasets import DATASETS, load_prompts
from tpspec.bench.machine import machine_info
from tpspec.config import KV_CACHE_DTYPES, QUANTIZATION_OPTIONS
from tpspec.llm import LLM
from tpspec.models.loader.resolve import resolve_model
from tpspec.sampling_params import SamplingParams

logger = logging.getLogger("bench_generate")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder/name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", choices=DATASETS, default="humaneval")
    p.add_argument("--input-len", type=int, default=128, help="prompt length of the random dataset")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes of tpspec")
    p.add_argument("--dtype", nargs="+", choices=sorted(TORCH_DTYPES), default=["float32"])
    p.add_argument("--torch-compile", nargs="+", choices=["off", "on"], default=["off"],
                   help="tpspec's compiled decode steps (EngineConfig.torch_compile, TP 1): off, on or both")
    p.add_argument("--quantization", nargs="+", choices=QUANTIZATION_OPTIONS, default=["auto"],
                   help="tpspec weight formats (auto: the engine's default; fp16 applies to float32 only)")
    p.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"],
                   help="tpspec's KV cache dtypes (each a configuration; repeat one to alternate: float32 float16 float32 float16)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--num-batch1", type=int, default=4, help="prompts run one at a time (batch 1)")
    p.add_argument("--concurrency", type=int, default=32, help="prompts submitted at once (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true", help="tpspec only (no speedup or token check)")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.num_batch1 < 0 or args.concurrency < 0 or min(args.tp) < 1 or args.num_batch1 + args.concurrency == 0:
        p.error("--max-tokens and --tp must be >= 1, --num-batch1 and --concurrency >= 0, not both 0")
    return args


def result(system: str, tp, dtype: str, batch: int, tokens: list[list[int]], elapsed: float, compiled: bool = False,
           quantization: str | None = None) -> dict:
    n_out = sum(len(t) for t in tokens)
    return dict(system=system, tp=tp, dtype=dtype, quantization=quantization, compiled=compiled, batch=batch,
                requests=len(tokens), output_tokens=n_out, elapsed_s=round(elapsed, 3), output_tok_s=n_out / elapsed)


# ---- transformers ---------------------------------------------------------------------------
def hf_generate(model, input_ids: torch.Tensor, mask: torch.Tensor, max_tokens: int, eos: int) -> torch.Tensor:
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=eos)
    return out[:, input_ids.shape[1]:]  # [batch, max_tokens]


def hf_batch1(model, prompts: list[list[int]], max_tokens: int, eos: int, dtype: str) -> tuple[dict, list[list[int]]]:
    tokens, elapsed = [], 0.0
    for ids in prompts:
        x = torch.tensor([ids])  # [1, prompt_len]
        start = time.perf_counter()
        out = hf_generate(model, x, torch.ones_like(x), max_tokens, eos)
        elapsed += time.perf_counter() - start
        tokens.append(out[0].tolist())
    return result("transformers", "-", dtype, 1, tokens, elapsed), tokens


def hf_batched(model, prompts: list[list[int]], max_tokens: int, eos: int, dtype: str) -> dict:
    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), eos, dtype=torch.long)  # [batch, width], left-padded
    mask = torch.zeros_like(x)
    for i, ids in enumerate(prompts):
        x[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    start = time.perf_counter()
    out = hf_generate(model, x, mask, max_tokens, eos)
    elapsed = time.perf_counter() - start
    return result("transformers", "-", dtype, len(prompts), out.tolist(), elapsed)


def bench_transformers(folder: str, dtype: str, b1: list[list[int]], batch: list[list[int]], args) -> tuple[list[dict], list, int]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[dtype]).eval()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    rows, ref = [], []
    with torch.inference_mode():
        warm = torch.tensor([(b1 or batch)[0]])  # [1, prompt_len]
        hf_generate(model, warm, torch.ones_like(warm), 4, eos)
        if b1:
            row, ref = hf_batch1(model, b1, args.max_tokens, eos, dtype)
            rows.append(row)
        if batch:
            rows.append(hf_batched(model, batch, args.max_tokens, eos, dtype))
    return rows, ref, eos


# ---- tpspec ---------------------------------------------------------------------------------
def tpspec_batch1(llm: LLM, prompts: list[list[int]], params: SamplingParams, tp: int, dtype: str, compiled: bool,
                  quantization: str) -> tuple[dict, list]:
    tokens, elapsed = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)
        elapsed += time.perf_counter() - start
        tokens.append(list(out[0].outputs[0].token_ids))
    return result("tpspec", tp, dtype, 1, tokens, elapsed, compiled, quantization), tokens


def tpspec_concurrent(llm: LLM, prompts: list[list[int]], params: SamplingParams, tp: int, dtype: str, compiled: bool,
                      quantization: str) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return result("tpspec", tp, dtype, len(prompts), [list(o.outputs[0].token_ids) for o in outs], elapsed, compiled,
                  quantization)


def bench_tpspec(tp: int, dtype: str, compiled: bool, quantization: str, kv_dtype: str, b1: list[list[int]],
                 batch: list[list[int]], args) -> tuple[list[dict], list]:
    llm = LLM(model=args.model, tensor_parallel_size=tp, dtype=dtype, max_num_seqs=max(args.concurrency, 1), seed=args.seed,
              torch_compile=compiled, quantization=quantization, kv_cache_dtype=kv_dtype)
    quantization = llm.llm_engine.config.quantization or "none"  # what "auto" became
    kv_dtype = llm.llm_engine.config.cache.kv_cache_dtype
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, tokens = [], []
    try:
        llm.generate([(b1 or batch)[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        if b1:
            row, tokens = tpspec_batch1(llm, b1, params, tp, dtype, compiled, quantization)
            rows.append(row)
        if batch:
            rows.append(tpspec_concurrent(llm, batch, params, tp, dtype, compiled, quantization))
    finally:
        llm.shutdown()
    for r in rows:
        r["kv_cache_dtype"] = kv_dtype
    return rows, tokens


def _isolated_entry(queue, fn, args) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def run_isolated(fn, *args):
    """``fn(*args)`` in a fresh spawned process (module-level ``fn``, picklable result): each
    tpspec config starts from a clean slate, not from the state earlier configs left in this
    process (torch.compile caches, allocator, thread settings)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_isolated_entry, args=(queue, fn, args))
    proc.start()
    try:
        status, value = queue.get()
    finally:
        proc.join()
    if status == "error":
        raise RuntimeError(f"config failed in its subprocess:\n{value}")
    return value


def count_equal(ours: list[list[int]], ref: list[list[int]], eos: int) -> int:
    """Requests whose greedy tokens equal the reference's, up to the first EOS in ours."""
    equal = 0
    for a, b in zip(ours, ref):
        end = a.index(eos) if eos in a else len(a)
        equal += a[:end] == b[:end]
    return equal


# ---- report ---------------------------------------------------------------------------------
def add_speedups(rows: list[dict]) -> None:
    """Speedup over transformers in the same dtype, and over transformers' default float32."""
    base = {(r["dtype"], r["batch"]): r["output_tok_s"] for r in rows if r["system"] == "transformers"}
    for r in rows:
        b, b32 = base.get((r["dtype"], r["batch"])), base.get(("float32", r["batch"]))
        r["speedup_vs_transformers"] = r["output_tok_s"] / b if b else None
        r["speedup_vs_transformers_float32"] = r["output_tok_s"] / b32 if b32 else None


def format_table(rows: list[dict]) -> str:
    lines = ["| System | TP | dtype | Quantization | KV cache | Compiled | Batch | Output tok/s | Speedup vs transformers "
             "(same dtype) | Speedup vs transformers float32 | Greedy tokens = transformers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speed = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    for r in rows:
        compiled = "-" if r["system"] == "transformers" else ("yes" if r["compiled"] else "no")
        lines.append(f"| {r['system']} | {r['tp']} | {r['dtype']} | {r.get('quantization') or '-'} | {r.get('kv_cache_dtype') or '-'} "
                     f"| {compiled} | {r['batch']} | {r['output_tok_s']:.1f} "
                     f"| {speed(r['speedup_vs_transformers'])} | {speed(r['speedup_vs_transformers_float32'])} "
                     f"| {r.get('tokens_equal') or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    folder = resolve_model(args.model)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(folder)
    n = max(args.num_batch1, args.concurrency)
    prompts = load_prompts(args.dataset, n, input_len=args.input_len, seed=args.seed, vocab_size=len(tok))
    ids = [tok(p).input_ids if isinstance(p, str) else p for p in prompts]
    b1, batch = ids[: args.num_batch1], ids[: args.concurrency]
    logger.info("%d %s prompts (%d-%d tokens), %d new tokens each", n, args.dataset, min(map(len, ids)), max(map(len, ids)), args.max_tokens)

    rows: list[dict] = []
    configs = [("transformers", None, d, False, None, None) for d in args.dtype if not args.skip_transformers]
    # torch_compile is TP 1 only, quantization "fp16" float32 only (EngineConfig).
    configs += [("tpspec", tp, d, c == "on", q, kv) for d in args.dtype for q in args.quantization for kv in args.kv_cache_dtype
                for tp in args.tp for c in args.torch_compile if (tp == 1 or c == "off") and (q != "fp16" or d == "float32")]
    refs, eos = {}, None
    for system, tp, dtype, compiled, quantization, kv_dtype in tqdm(configs, desc="configs", unit="config"):
        logger.info("measuring %s%s %s%s%s", system, f" TP {tp}" if tp else "", dtype, f" {quantization}" if quantization else "",
                    " compiled" if compiled else "")
        if system == "transformers":
            new, refs[dtype], eos = bench_transformers(folder, dtype, b1, batch, args)
        else:
            new, tokens = run_isolated(bench_tpspec, tp, dtype, compiled, quantization, kv_dtype, b1, batch, args)
            if refs.get(dtype) and tokens:
                new[0]["tokens_equal"] = f"{count_equal(tokens, refs[dtype], eos)}/{len(tokens)}"
        for r in new:
            logger.info("%s TP %s %s batch %d: %.1f output tok/s", r["system"], r["tp"], dtype, r["batch"], r["output_tok_s"])
        rows += new
    add_speedups(rows)
    print(format_table(rows))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(dict(machine=machine_info(), args=vars(args), results=rows), f, indent=2)
        logger.info("wrote %s", args.result_file)
    return rows


if __name__ == "__main__":
    main()
