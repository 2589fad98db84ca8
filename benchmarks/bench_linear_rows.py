"""float32 CPU matmuls by row count: X·Aᵀ (``F.linear``, MKL), (A·Xᵀ)ᵀ, and oneDNN's matmul on the
weight reordered once (``layers.cpu_weights.packed_weight_of``, what tpspec runs up to 64 rows), over the default model's
weights as a forward streams them (every matrix of all 30 layers, then the LM head: 538 MB, far
more than any cache), for the row counts a decode, a speculative verification or a draft block has.

  python3 benchmarks/bench_linear_rows.py [--rows 1 2 4 8 16 32 64 128] [--repeats 5]

Each figure: the fastest of ``--repeats`` passes over all matrices, variants alternating.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tpspec.bench.machine import machine_info
from tpspec.layers.cpu_weights import ONEDNN_PACK_ROWS, linear

# SmolLM2-135M: hidden 576, 9 heads + 3 KV heads of 64, MLP 1536, 30 layers, vocab 49152.
LAYER_SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def variants(packed: dict[int, torch.Tensor]):
    """name -> fn(x, w); ``packed`` maps id(w) to its reordered weight."""
    return {
        "x_at": lambda x, w: F.linear(x, w),
        "a_xt": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
        "onednn": lambda x, w: linear(x, w, packed=packed[id(w)]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for _ in range(NUM_LAYERS) for s in LAYER_SHAPES]
    head = torch.randn(LM_HEAD, generator=gen)
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS) for w in [*weights, head]}
    results = []
    for rows in args.rows:
        x = torch.randn(rows, 576, generator=gen)
        xm = torch.randn(rows, 1536, generator=gen)
        best = {name: [float("inf"), float("inf")] for name in variants(packed)}  # layers, head
        for _ in range(args.repeats):
            for name, fn in variants(packed).items():
                t0 = time.perf_counter()
                for w in weights:
                    fn(xm if w.shape[1] == 1536 else x, w)
                t1 = time.perf_counter()
                fn(x, head)
                t2 = time.perf_counter()
                best[name][0] = min(best[name][0], t1 - t0)
                best[name][1] = min(best[name][1], t2 - t1)
        row = {"rows": rows}
        for name, (layers, lm) in best.items():
            row[f"{name}_layers_ms"] = round(layers * 1e3, 2)
            row[f"{name}_lm_head_ms"] = round(lm * 1e3, 2)
        results.append(row)
        print(json.dumps(row))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": machine_info(), "threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
