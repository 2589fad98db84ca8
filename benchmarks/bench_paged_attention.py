"""One attention layer's call (``layers.attention.Attention``: the new tokens' K/V written, then
attention over the paged cache) through tpspec's CPU kernel (``paged_attention``) and through
PyTorch's path (gathered keys, SDPA or two batched matmuls), same inputs, per number of sequences,
context length and new tokens per sequence (float32 steps take the kernel whatever their length,
so that a query's output depends on its own keys alone). The default model's attention shape (9 heads, 3 KV heads, head size
64), float32, each sequence's blocks scattered; median of ``--repeats`` timings of ``--calls``
calls each.

  python3 benchmarks/bench_paged_attention.py --result-file benchmarks/results/paged_attention_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tpspec.bench.machine import machine_info
from tpspec.layers import cpu_kernels
from tpspec.layers.attention import Attention, AttentionMetadata

BLOCK = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    p.add_argument("--query-lens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


def time_calls(attn, inputs, md, calls: int, repeats: int) -> float:
    """Median seconds a call."""
    for _ in range(5):
        attn(*inputs, md)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            attn(*inputs, md)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = cpu_kernels.unavailable()
    if reason:
        raise SystemExit(f"tpspec's CPU kernels are unavailable here: {reason}")
    module = cpu_kernels.kernels()
    attn = Attention(9, 3, 64, torch.arange(9) // 3)
    rows = []
    print("| Seqs | Context | New tokens a seq | Kernel (us) | PyTorch (us) | PyTorch / kernel | Max difference |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for seqs in args.seqs:
            for ctx in args.contexts:
                blocks = -(-ctx // BLOCK)
                cache = (torch.randn(seqs * blocks * BLOCK, 3, 64), torch.randn(seqs * blocks * BLOCK, 3, 64))
                tables = [list(range(s * blocks, (s + 1) * blocks))[::-1] for s in range(seqs)]  # scattered
                for q_len in args.query_lens:
                    md = AttentionMetadata.build([q_len] * seqs, [ctx] * seqs, tables, BLOCK, torch.device("cpu"))
                    n = q_len * seqs
                    inputs = (torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64), cache)
                    cpu_kernels._MODULE = module
                    kernel_s = time_calls(attn, inputs, md, args.calls, args.repeats)
                    kernel_out = attn(*inputs, md)
                    cpu_kernels._MODULE = None  # PyTorch's path
                    torch_s = time_calls(attn, inputs, md, args.calls, args.repeats)
                    diff = (attn(*inputs, md) - kernel_out).abs().max().item()
                    cpu_kernels._MODULE = module
                    rows.append(dict(seqs=seqs, context=ctx, query_len=q_len, kernel_us=kernel_s * 1e6,
                                     torch_us=torch_s * 1e6, max_diff=diff))
                    print(f"| {seqs} | {ctx} | {q_len} | {kernel_s * 1e6:.1f} | {torch_s * 1e6:.1f} | "
                          f"{torch_s / kernel_s:.2f} | {diff:.1e} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
