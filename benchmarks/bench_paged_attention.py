"""One attention layer's call (``layers.attention.Attention``: the new tokens' K/V written, then
attention over the paged cache) through tpspec's CPU kernel (``paged_attention``) and through
PyTorch's path (gathered keys, SDPA or two batched matmuls), same inputs, per number of sequences,
context length and new tokens per sequence (float32 steps take the kernel whatever their length,
so that a query's output depends on its own keys alone). The default model's attention shape (9 heads, 3 KV heads, head size
64), float32, each sequence's blocks scattered; median of ``--repeats`` timings of ``--calls``
calls each. ``--layers N`` cycles through N layers' caches, as a forward does (with 30, a
sequence's keys are no longer in the CPU's caches when its next call comes).

``--baseline-commit REV`` also builds the kernel as it was at REV (its ``decode_ops.cpp``, from
git) and times it in the same run on the same inputs (the kernel call alone, both; float32 caches,
or float16 ones with ``--baseline-float16``): how a change to the kernel moved it, free of the
drift between runs, and whether its bits moved (a line says so).

  python3 benchmarks/bench_paged_attention.py --result-file benchmarks/results/paged_attention_avx2.json
  python3 benchmarks/bench_paged_attention.py --layers 30 --baseline-commit HEAD~1 [--baseline-float16]

``--compare-wide`` also times the kernel alone on its 8-lane (AVX2) path against its 16-lane (AVX-512)
one, alternating rounds, float16 caches (the CPU default), and checks that they give the same bits:
what the AVX-512 path saves where the CPU has it.

  python3 benchmarks/bench_paged_attention.py --layers 30 --seqs 1 32 --contexts 300 1000 --query-lens 1 4 --compare-wide

``--kv-float16`` also times the kernel alone on a float16 copy of the caches (their values rounded to
float16 in both, so the outputs must have the same bits), alternating rounds with the float32 ones:
what a float16 KV cache (``--kv-cache-dtype``, the CPU default) saves.

  python3 benchmarks/bench_paged_attention.py --layers 30 --seqs 1 32 --contexts 300 1000 --query-lens 1 4 --kv-float16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
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
    p.add_argument("--layers", type=int, default=1, help="layers' caches cycled through (30: cold, as in a forward)")
    p.add_argument("--baseline-commit", default=None, help="also time the kernel as it was at this commit")
    p.add_argument("--baseline-float16", action="store_true",
                   help="compare with the baseline on float16 caches (the CPU default) instead of float32 ones")
    p.add_argument("--kv-float16", action="store_true", help="also time the kernel on float16 caches of the same values")
    p.add_argument("--compare-wide", action="store_true",
                   help="also time the kernel's AVX2 path against its AVX-512 one (float16 caches)")
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


# {wide}: ", bool wide" where the baseline's kernel takes its path (since the AVX-512 one), else ""
BASELINE_BINDING = """#include <torch/extension.h>
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                              torch::Tensor token_seq, torch::Tensor key_range, torch::Tensor kv_head, double scale{wide});
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("paged_attention", &paged_attention); }}
"""


def build_baseline(rev: str):
    """The paged-attention kernel of commit ``rev``, built as a module of its own, and whether it
    takes a ``wide`` argument (its AVX-512 path)."""
    from torch.utils.cpp_extension import load

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    folder = tempfile.mkdtemp(prefix="paged_attention_baseline_")
    for name in ("decode_ops.cpp", "vector_sum.h"):
        text = subprocess.run(["git", "show", f"{rev}:src/tpspec/layers/csrc/{name}"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "decode_ops.cpp")) as f:
        takes_wide = "double scale, bool wide" in f.read()
    with open(os.path.join(folder, "binding.cpp"), "w") as f:
        f.write(BASELINE_BINDING.format(wide=", bool wide" if takes_wide else ""))
    sources = [os.path.join(folder, n) for n in ("decode_ops.cpp", "binding.cpp")]
    module = load(name="paged_attention_baseline", sources=sources, build_directory=folder, verbose=False,
                  extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return module, takes_wide


def time_calls(call, layers: int, calls: int, repeats: int) -> float:
    """Median seconds a call; ``call(layer)`` runs one on that layer's cache."""
    for layer in range(max(5, layers)):
        call(layer % layers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            call(i % layers)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def alternating_us(first, second, layers: int, calls: int, repeats: int, rounds: int) -> tuple[float, float]:
    """Median microseconds a call of ``first`` and of ``second`` (each ``call(layer)``), timed in
    alternating rounds on the same inputs."""
    a, b = [], []
    for _ in range(rounds):
        a.append(time_calls(first, layers, calls, repeats))
        b.append(time_calls(second, layers, calls, repeats))
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = cpu_kernels.unavailable()
    if reason:
        raise SystemExit(f"tpspec's CPU kernels are unavailable here: {reason}")
    module = cpu_kernels.kernels()
    baseline, baseline_wide = build_baseline(args.baseline_commit) if args.baseline_commit else (None, False)
    wide = cpu_kernels.wide()
    if args.compare_wide and not wide:
        raise SystemExit("--compare-wide needs a CPU with AVX-512 and no ISA cap")
    attn = Attention(9, 3, 64, torch.arange(9) // 3)
    rows = []
    extra = " Kernel call (us) | Baseline call (us) | Baseline / kernel |" if baseline else ""
    extra += " Float32 cache (us) | Float16 cache (us) | Float32 / float16 |" if args.kv_float16 else ""
    extra += " AVX2 path (us) | AVX-512 path (us) | AVX2 / AVX-512 |" if args.compare_wide else ""
    print(f"| Seqs | Context | New tokens a seq | Kernel (us) | PyTorch (us) | PyTorch / kernel | Max difference |{extra}")
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if baseline else "") + ("---|---|---|" if args.kv_float16 else "")
          + ("---|---|---|" if args.compare_wide else ""))
    with torch.inference_mode():
        for seqs in args.seqs:
            for ctx in args.contexts:
                blocks = -(-ctx // BLOCK)
                caches = [(torch.randn(seqs * blocks * BLOCK, 3, 64), torch.randn(seqs * blocks * BLOCK, 3, 64))
                          for _ in range(args.layers)]
                tables = [list(range(s * blocks, (s + 1) * blocks))[::-1] for s in range(seqs)]  # scattered
                for q_len in args.query_lens:
                    md = AttentionMetadata.build([q_len] * seqs, [ctx] * seqs, tables, BLOCK, torch.device("cpu"))
                    n = q_len * seqs
                    q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
                    cpu_kernels._MODULE = module
                    kernel_s = time_calls(lambda i: attn(q, k, v, caches[i], md), args.layers, args.calls, args.repeats)
                    kernel_out = attn(q, k, v, caches[0], md)
                    cpu_kernels._MODULE = None  # PyTorch's path
                    torch_s = time_calls(lambda i: attn(q, k, v, caches[i], md), args.layers, args.calls, args.repeats)
                    diff = (attn(q, k, v, caches[0], md) - kernel_out).abs().max().item()
                    cpu_kernels._MODULE = module
                    row = dict(seqs=seqs, context=ctx, query_len=q_len, kernel_us=kernel_s * 1e6,
                               torch_us=torch_s * 1e6, max_diff=diff)
                    line = (f"| {seqs} | {ctx} | {q_len} | {kernel_s * 1e6:.1f} | {torch_s * 1e6:.1f} | "
                            f"{torch_s / kernel_s:.2f} | {diff:.1e} |")
                    key_range = md.key_range(None)

                    def kernel_call(mod, cs, path=None):  # the kernel alone on these caches (path: its wide argument)
                        if path is None:
                            path = wide if mod is module else (False if baseline_wide else None)
                        tail = () if path is None else (path,)
                        return lambda i: mod.paged_attention(q, *cs[i], md.context_slots, md.token_seq, key_range,
                                                             attn.kv_head_of_head, attn.scale, *tail)

                    timing = (args.layers, args.calls, args.repeats)
                    if baseline:  # the two kernels, alternating rounds, on the same inputs
                        compared = [(k.half(), v.half()) for k, v in caches] if args.baseline_float16 else caches
                        if not torch.equal(kernel_call(module, compared)(0), kernel_call(baseline, compared)(0)):
                            print(f"  (seqs {seqs}, context {ctx}, {q_len} new: other bits than the baseline's)")
                        new_us, old_us = alternating_us(kernel_call(module, compared), kernel_call(baseline, compared),
                                                        *timing, rounds=2)
                        row.update(kernel_call_us=new_us, baseline_call_us=old_us)
                        line += f" {new_us:.1f} | {old_us:.1f} | {old_us / new_us:.2f} |"
                    if args.kv_float16:  # the kernel on each, alternating rounds
                        # the caches as they are now (the layer wrote the new tokens), float16 values in both
                        rounded = [(k.half().float(), v.half().float()) for k, v in caches]
                        half_caches = [(k.half(), v.half()) for k, v in caches]
                        if not torch.equal(kernel_call(module, rounded)(0), kernel_call(module, half_caches)(0)):
                            raise SystemExit("a float16 cache gave other bits than float32 holding its values")
                        f32_us, f16_us = alternating_us(kernel_call(module, rounded), kernel_call(module, half_caches),
                                                        *timing, rounds=3)
                        row.update(float32_cache_us=f32_us, float16_cache_us=f16_us)
                        line += f" {f32_us:.1f} | {f16_us:.1f} | {f32_us / f16_us:.2f} |"
                    if args.compare_wide:  # the two paths, alternating rounds, on float16 caches
                        half_caches = [(k.half(), v.half()) for k, v in caches]
                        if not torch.equal(kernel_call(module, half_caches, False)(0), kernel_call(module, half_caches, True)(0)):
                            raise SystemExit("the AVX-512 path gave other bits than the AVX2 one")
                        narrow_us, wide_us = alternating_us(kernel_call(module, half_caches, False),
                                                            kernel_call(module, half_caches, True), *timing, rounds=3)
                        row.update(avx2_path_us=narrow_us, avx512_path_us=wide_us)
                        line += f" {narrow_us:.1f} | {wide_us:.1f} | {narrow_us / wide_us:.2f} |"
                    rows.append(row)
                    print(line)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "layers": args.layers, "baseline_commit": args.baseline_commit,
                       "baseline_float16": args.baseline_float16,
                       "kv_float16": args.kv_float16, "compare_wide": args.compare_wide,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
