"""The CPU's model and the instruction-set extensions that decide which dtypes have fast kernels.

CPUs of one name differ: one "AMD EPYC" has AVX-512 with BF16 (native bfloat16 dot products),
another only AVX2, where torch emulates bfloat16 matrix products: as fast as float16 for one row,
2.6x slower than float32 at 32 rows (``benchmarks/README.md``, AVX2 emulation). Read from ``/proc/cpuinfo`` (Linux); elsewhere the flags are unknown (empty).
"""

from __future__ import annotations

import functools
import os
import platform

ISA_PREFIXES = ("avx", "amx", "fma", "f16c")
# Environment variables that cap the ISA torch's kernel libraries use (ATen, oneDNN, MKL, fbgemm):
# set to AVX2 on an AVX-512 CPU, they give an AVX2 run of the same code.
ISA_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS")
# Either gives bfloat16 matrix products native kernels (oneDNN); without them they are emulated.
BFLOAT16_ISA = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_model_and_isa() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and its vector ISA flags (``avx2``, ``avx512_bf16``, ``amx_tile``, ...), sorted."""
    model, flags = platform.processor() or platform.machine(), ()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags = tuple(sorted(t for t in value.split() if t.startswith(ISA_PREFIXES)))
                    break
    except OSError:
        pass
    return model, flags


def emulated_dtype_warning(dtype: str, flags: tuple[str, ...] | None = None) -> str | None:
    """Why ``dtype`` is a poor choice on this CPU, or None. ``flags``: the CPU's (default: read them)."""
    flags = cpu_model_and_isa()[1] if flags is None else flags
    if dtype == "bfloat16" and flags and not any(f in flags for f in BFLOAT16_ISA):
        return (
            "--dtype bfloat16 on a CPU without AVX512-BF16 or AMX-BF16: its matrix products are emulated, and "
            "beyond a few rows (batches, prefill, speculative verification) several times slower than float32; "
            "float32 is faster here for serving, float16 or bfloat16 only for one sequence at a time"
        )
    return None


def isa_caps() -> dict[str, str]:
    """The ISA caps (``ISA_CAP_VARS``) set in this process's environment."""
    return {k: os.environ[k] for k in ISA_CAP_VARS if k in os.environ}


def has_fbgemm() -> bool:
    """Whether this torch build has fbgemm (x86 builds), whose float16 GEMM ``layers.cpu_weights`` uses."""
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines
