"""tpspec's C++ kernels for x86 CPUs with AVX2, FMA and F16C (``csrc/``): the Q4_1 and Q8_0
products (``layers.q4_1``, ``layers.q8_0``; 16 lanes wide where the CPU has AVX-512, ``wide``), the
same weights in integer multiply-adds (``layers.int8_dot``; AVX-512 VNNI where the CPU has it), and
RMSNorm with its residual add and attention of a few queries per sequence over the paged KV cache
(decodes, verification; ``decode_ops.cpp``), each one call where PyTorch dispatches several ops
(and gathers the keys). Built with the machine's C++ compiler (and ninja)
at the first engine start, ~20 s on a 2-core Zen 5 (``make demo`` starts one), then cached by torch.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import shutil
import sys

import torch

logger = logging.getLogger(__name__)

KERNEL_ISA = ("avx2", "fma", "f16c")  # what the kernels are compiled for
WIDE_ISA = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what the products' and attention's 16-lane paths need
_SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp")))
_MODULE = None  # the module once built and imported


@functools.lru_cache(maxsize=1)
def _build():
    """The compiled module, or the reason there is none (a string)."""
    global _MODULE
    from tpspec.cpu_features import cpu_model_and_isa

    flags = cpu_model_and_isa()[1]
    missing = [f for f in KERNEL_ISA if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH; pip's ninja sits beside this interpreter
        here = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(here, "ninja")):
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    logger.info("Loading tpspec's CPU kernels (compiled on first use, ~20 s, then cached by torch)")
    try:
        module = load(name="tpspec_cpu_kernels", sources=_SOURCES, verbose=False,
                      extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no headers: say why
        return f"building them failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e})"
    _MODULE = module
    return module


@functools.lru_cache(maxsize=1)
def wide() -> bool:
    """Whether the Q4_1 and Q8_0 products and paged attention take their AVX-512 paths (the integer
    products too, with VNNI: ``int8_dot.isa``): the CPU has ``WIDE_ISA`` and no
    ISA cap (``ATEN_CPU_CAPABILITY=avx2``, see ``cpu_features.ISA_CAP_VARS``) asks for an AVX2 run."""
    from tpspec.cpu_features import cpu_model_and_isa

    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2")
    return not capped and all(f in cpu_model_and_isa()[1] for f in WIDE_ISA)


def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can; builds them on first call)."""
    module = _build()
    return module if isinstance(module, str) else None


def kernels():
    """The compiled module (building it on first call); RuntimeError where there is none."""
    module = _build()
    if isinstance(module, str):
        raise RuntimeError(f"tpspec's CPU kernels are unavailable: {module}")
    return module


def usable(*tensors) -> object | None:
    """The module if something built it already (an engine on CPU does, at start) and every one of
    ``tensors`` (None: skipped) is a float32 CPU tensor outside autograd and torch.compile, what the
    ops of ``decode_ops.cpp`` need; else None. Layers with a PyTorch path take the kernels only then (they never
    build them themselves)."""
    if _MODULE is None or torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu or grad and t.requires_grad):
            return None
    return _MODULE
