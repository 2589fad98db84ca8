"""A target forward (with its LM head) with tpspec's rotary and SwiGLU kernels against the same
forward with PyTorch's ops for those two steps, alternating in one process (every other forward),
on the default model (or ``--model``) at TP 1 and its default quantization: c sequences of ``--context`` tokens,
``--rows`` new tokens each (1: decode; k + 1: a verification), random ids, the same KV cache.
Medians over ``--forwards`` forwards of each kind, after ``--warmup`` of each. With
``--attention-baseline-commit REV`` the other forward is instead this one with the paged-attention
kernel of commit REV; with ``--kv-float32`` it is this one over a float32 copy of the KV cache (the
engine's default on CPU is float16, ``--kv-cache-dtype``); with ``--kv-write-pytorch`` it is this
one writing the new keys and values through PyTorch's ops (``.to`` and ``index_copy_``, as before
the ``write_kv`` kernel); with ``--modules`` it is this one through the layers' modules instead of
their plans of kernel calls (``models/layer_plans.py``).

  python3 benchmarks/bench_forward_ops.py --shapes 1x1 1x4 32x1 --result-file benchmarks/results/forward_ops.json
  python3 benchmarks/bench_forward_ops.py --attention-baseline-commit c5563c8 --context 1000 --shapes 1x1 1x4
  python3 benchmarks/bench_forward_ops.py --kv-float32 --context 400 --shapes 1x1 1x4 32x1
  python3 benchmarks/bench_forward_ops.py --kv-write-pytorch --context 400 --shapes 1x1 1x4 32x1
  python3 benchmarks/bench_forward_ops.py --modules --context 400 --shapes 1x1 1x4 32x1 [--model gemma-3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

from tpspec.bench.machine import machine_info
from tpspec.layers import activation, cpu_kernels, rotary
from tpspec.layers.attention import AttentionMetadata


class _Substituted:
    """The loaded kernels, with some ops replaced (name -> callable)."""

    def __init__(self, kernels, **ops):
        self.kernels, self.ops = kernels, ops

    def __getattr__(self, name):
        return self.ops[name] if name in self.ops else getattr(self.kernels, name)


def _pytorch_write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """What the attention layer did before the ``write_kv`` kernel."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def measure(engine, seqs: int, rows: int, context: int, forwards: int, warmup: int, baseline=None,
            kv_float32: bool = False, kv_write_pytorch: bool = False, modules: bool = False) -> dict:
    runner = engine.executor.runner
    model = runner.model
    block = engine.config.cache.block_size
    per_seq = -(-(context + 8) // block)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(seqs)]
    kernels = rotary.cpu_kernels
    without = types.SimpleNamespace(usable=lambda *tensors: None)  # the layers' PyTorch path
    loaded = cpu_kernels._MODULE
    times: dict[str, list[float]] = {"kernels": [], "pytorch": []}
    caches = {"kernels": runner.kv_caches, "pytorch": runner.kv_caches}
    if kv_float32:  # "pytorch" stands for the same forward over a float32 copy of the cache
        caches["pytorch"] = [(k.float(), v.float()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        for i in range(2 * (forwards + warmup)):
            kind = "kernels" if i % 2 else "pytorch"
            # With --modules "pytorch" stands for the modules' path; the rotary and SwiGLU comparison
            # swaps ops inside the modules, so it runs through them on both sides
            model.use_layer_plans = kind == "kernels" if modules else kv_float32 or kv_write_pytorch or baseline is not None
            if kv_float32 or modules:
                pass
            elif kv_write_pytorch:  # "pytorch" stands for the keys and values written by PyTorch's ops
                cpu_kernels._MODULE = loaded if kind == "kernels" else _Substituted(loaded, write_kv=_pytorch_write_kv)
            elif baseline is None:
                rotary.cpu_kernels = activation.cpu_kernels = kernels if kind == "kernels" else without
            else:  # "pytorch" stands for the baseline attention kernel
                cpu_kernels._MODULE = loaded if kind == "kernels" else _Substituted(
                    loaded, paged_attention=baseline.paged_attention)
            ids = torch.randint(0, model.config.vocab_size, (seqs * rows,))
            positions = torch.tensor([context - rows + j for _ in range(seqs) for j in range(rows)])
            t0 = time.perf_counter()
            md = AttentionMetadata.build([rows] * seqs, [context] * seqs, tables, block, torch.device("cpu"))
            hidden, _ = model(ids, positions, caches[kind], md)
            model.compute_logits(hidden)
            if i >= 2 * warmup:
                times[kind].append(time.perf_counter() - t0)
    rotary.cpu_kernels = activation.cpu_kernels = kernels
    cpu_kernels._MODULE = loaded
    model.use_layer_plans = type(model).use_layer_plans
    k, p = statistics.median(times["kernels"]), statistics.median(times["pytorch"])
    return {"seqs": seqs, "rows": rows, "context": context, "kernels_ms": 1e3 * k, "pytorch_ms": 1e3 * p,
            "pytorch_over_kernels": p / k}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x4", "32x1"], help="SEQSxROWS")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--forwards", type=int, default=90)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--attention-baseline-commit", default=None,
                   help="compare against this commit's paged-attention kernel instead of PyTorch's rotary and SwiGLU")
    p.add_argument("--kv-float32", action="store_true",
                   help="compare against the same forward over a float32 KV cache instead")
    p.add_argument("--kv-write-pytorch", action="store_true",
                   help="compare against the same forward writing keys and values through PyTorch's ops instead")
    p.add_argument("--model", default=None, help="a model name or folder (default: the default model)")
    p.add_argument("--modules", action="store_true",
                   help="compare against the same forward through the layers' modules instead of their plans")
    p.add_argument("--result-file")
    args = p.parse_args()
    from tpspec.engine.llm_engine import LLMEngine

    baseline = None
    if args.attention_baseline_commit:
        from bench_paged_attention import build_baseline

        baseline, baseline_wide = build_baseline(args.attention_baseline_commit)
        if not baseline_wide:  # a kernel from before its AVX-512 path: called without the path argument
            old_kernel = baseline.paged_attention
            baseline = types.SimpleNamespace(paged_attention=lambda *args: old_kernel(*args[:8]))
    engine = LLMEngine.from_args(model=args.model, max_num_seqs=64)
    results = []
    other = ("a float32 KV cache" if args.kv_float32 else "PyTorch's KV writes" if args.kv_write_pytorch
             else "the modules" if args.modules else f"{args.attention_baseline_commit}'s attention" if baseline
             else "PyTorch ops")
    this = "A float16 KV cache" if args.kv_float32 else "Layer plans" if args.modules else "Kernels"
    print(f"| Seqs | Rows a seq | {this} (ms) | {other} (ms) | {other} / {this.lower()} |\n|---|---|---|---|---|")
    for shape in args.shapes:
        seqs, rows = (int(v) for v in shape.split("x"))
        r = measure(engine, seqs, rows, args.context, args.forwards, args.warmup, baseline, args.kv_float32,
                    args.kv_write_pytorch, args.modules)
        results.append(r)
        print(f"| {seqs} | {rows} | {r['kernels_ms']:.2f} | {r['pytorch_ms']:.2f} | {r['pytorch_over_kernels']:.3f} |")
    engine.shutdown()
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
