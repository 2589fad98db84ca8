"""How long a TP engine takes to start, engine after engine in one process: the first pays the
fork server's own start (an interpreter importing torch and the model runner), the later ones only
fork it (``executor/fork_server.py``). Tiny random Llama (tests' shape), greedy 8 tokens each.

  python3 benchmarks/bench_engine_start.py --tp 2 --engines 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tpspec import LLM, SamplingParams  # noqa: E402
from tpspec.bench.machine import machine_info  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--engines", type=int, default=3)
    args = p.parse_args()
    from tests.conftest import _write_tiny

    folder = _write_tiny(tempfile.mkdtemp(), "llama")
    print(machine_info())
    for i in range(args.engines):
        t0 = time.perf_counter()
        with LLM(folder, tensor_parallel_size=args.tp, num_kv_blocks=64) as llm:
            t1 = time.perf_counter()
            llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        print(f"engine {i + 1}: start {t1 - t0:.2f} s, start to shut down {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
