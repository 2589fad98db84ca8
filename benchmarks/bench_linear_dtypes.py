"""Linear layers by dtype and row count on this CPU: why float16 serves one sequence at a time
and, with AVX512-BF16, bfloat16 serves batches; without it, float32 (`README.md`, choosing `--dtype`).

Times ``torch.nn.functional.linear`` over one forward's matrices of the default model (30 layers
of qkv 960×576, o 576×576, gate+up 3072×576, down 576×1536; random weights) for each row count
and dtype: the best of ``--repeats`` passes after one warm-up pass, on ``--threads`` threads.

  python3 benchmarks/bench_linear_dtypes.py
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python3 benchmarks/bench_linear_dtypes.py

The first line printed names the CPU, its ISA flags and any of those caps in effect.
"""

from __future__ import annotations

import argparse
import time

import torch

from tpspec.cpu_features import cpu_model_and_isa, isa_caps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def time_pass(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Best seconds of one pass of ``linear`` over every matrix, ``rows`` input rows."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    for w in weights:
        torch.nn.functional.linear(inputs[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 100])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = {name: [torch.randn(o, i).to(dt) for _ in range(LAYERS) for o, i in SHAPES] for name, dt in DTYPES.items()}
    nbytes = {name: sum(w.numel() * w.element_size() for w in ws) for name, ws in weights.items()}
    model, flags = cpu_model_and_isa()
    caps = isa_caps()
    print(f"{model}; ISA {' '.join(flags)}; caps {caps or 'none'}; torch {torch.__version__}")
    print(f"{args.threads} thread(s); ms per pass over {LAYERS} layers (weights GB/s)")
    print("| rows | " + " | ".join(DTYPES) + " |")
    print("|---|" + "---|" * len(DTYPES))
    for rows in args.rows:
        cells = []
        for name in DTYPES:
            s = time_pass(weights[name], rows, args.repeats)
            cells.append(f"{1e3 * s:.1f} ms ({nbytes[name] / s / 1e9:.0f} GB/s)")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
