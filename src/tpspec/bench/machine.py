"""What a benchmark result was measured on and with: CPU model and ISA flags (and any caps on
them), cores, Python, torch and its threads, the commit (and whether the tree was dirty; None
outside a git checkout), the command line. Every result file of ``benchmarks/`` and ``tpspec
bench`` records it: figures from two CPUs are never one ratio."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from tpspec.cpu_features import cpu_model_and_isa, isa_caps


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict:
    import torch  # here: ``tpspec bench serve`` measures any server and need not load torch otherwise

    model, flags = cpu_model_and_isa()
    status = _git("status", "--porcelain")
    return {
        "cpu": model,
        "isa": list(flags),
        "avx512": any(f.startswith("avx512") for f in flags),
        "isa_caps": isa_caps(),  # e.g. an AVX2 run on an AVX-512 CPU
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
