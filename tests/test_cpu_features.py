"""The CPU's ISA flags decide which dtypes have native kernels: bfloat16 without AVX512-BF16 or
AMX-BF16 is emulated, and choosing it says so at start-up."""

from __future__ import annotations

import logging
import platform

import pytest

import tpspec.cpu_features as cpu_features
from tpspec.engine.engine_args import EngineArgs

AVX2_ONLY = ("avx", "avx2", "f16c", "fma")
AVX512_BF16 = ("avx", "avx2", "avx512_bf16", "avx512bw", "avx512f", "f16c", "fma")


@pytest.mark.skipif(platform.machine() != "x86_64" or platform.system() != "Linux", reason="x86 Linux flags")
def test_this_cpus_flags_are_read():
    model, flags = cpu_features.cpu_model_and_isa()
    assert model and "avx2" in flags and list(flags) == sorted(flags)
    assert all(f.startswith(cpu_features.ISA_PREFIXES) for f in flags)


def test_bfloat16_without_native_kernels_is_flagged():
    assert "emulated" in cpu_features.emulated_dtype_warning("bfloat16", AVX2_ONLY)
    assert cpu_features.emulated_dtype_warning("bfloat16", AVX512_BF16) is None
    assert cpu_features.emulated_dtype_warning("bfloat16", ("avx2", "amx_bf16", "amx_tile")) is None
    for dtype in ("float32", "float16"):
        assert cpu_features.emulated_dtype_warning(dtype, AVX2_ONLY) is None
    assert cpu_features.emulated_dtype_warning("bfloat16", ()) is None  # flags unknown: no claim


@pytest.mark.parametrize("flags", [AVX2_ONLY, AVX512_BF16], ids=["avx2", "avx512-bf16"])
def test_the_engine_warns_when_bfloat16_is_emulated(tiny_llama, flags, monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "cpu_model_and_isa", lambda: ("test CPU", flags))
    with caplog.at_level(logging.WARNING, logger="tpspec"):
        config = EngineArgs(model=tiny_llama, dtype="bfloat16", num_kv_blocks=8, max_model_len=64).create_engine_config("cpu")
    assert config.dtype == "bfloat16"
    warned = any("AVX512-BF16" in r.getMessage() for r in caplog.records)
    assert warned == (flags == AVX2_ONLY)
