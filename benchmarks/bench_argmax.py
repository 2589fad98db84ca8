"""Greedy argmax over logits: PyTorch's ``torch.argmax`` against tpspec's CPU kernel
(``layers.argmax.argmax_rows``), alternating in one process, on random float32 logits of
``--rows`` rows and ``--vocab`` columns (49,152: the default model's vocabulary; 8,192: its
EAGLE-3 head's draft vocabulary). Medians of ``--repeats`` rounds of ``--calls`` calls each.

  python3 benchmarks/bench_argmax.py --result-file benchmarks/results/argmax.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tpspec.bench.machine import machine_info
from tpspec.layers import cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 8192])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--result-file")
    args = p.parse_args()
    reason = cpu_kernels.unavailable()
    if reason:
        raise SystemExit(f"tpspec's CPU kernels are unavailable here: {reason}")
    kernel = cpu_kernels.kernels().argmax_rows
    info = machine_info()
    print(f"{info['cpu']}; ISA {' '.join(info['isa'])}; {torch.get_num_threads()} thread(s)")
    print("| Rows | Vocab | torch.argmax (us) | kernel (us) | torch / kernel |\n|---|---|---|---|---|")
    results = []
    for vocab in args.vocab:
        for rows in args.rows:
            x = torch.randn(rows, vocab)
            assert torch.equal(kernel(x), x.argmax(dim=-1))
            times = {"torch": [], "kernel": []}
            for _ in range(args.repeats):
                for name, fn in (("torch", lambda: x.argmax(dim=-1)), ("kernel", lambda: kernel(x))):
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            t, k = statistics.median(times["torch"]), statistics.median(times["kernel"])
            results.append({"rows": rows, "vocab": vocab, "torch_us": t, "kernel_us": k})
            print(f"| {rows} | {vocab} | {t:.1f} | {k:.1f} | {t / k:.1f} |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
