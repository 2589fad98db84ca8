"""One source for engine options: ``EngineArgs`` builds the CLI flags of ``generate``/``serve``
(defaults included), ``LLM``'s keywords and ``bench compare``'s server flags, whose argv the
``serve`` parser reads back to the same options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpspec import LLM
from tpspec.bench.server_options import ServerOptions
from tpspec.cli import build_parser, engine_kwargs
from tpspec.config import CacheConfig, EngineConfig, SchedulerConfig
from tpspec.engine.engine_args import EngineArgs


def test_defaults_are_the_configs():
    args = EngineArgs()
    assert args.max_num_seqs == SchedulerConfig().max_num_seqs
    assert args.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert args.block_size == CacheConfig().block_size and args.kv_cache_memory_gb == CacheConfig().kv_cache_memory_gb
    assert args.sampling_mode == EngineConfig.sampling_mode and args.torch_compile is EngineConfig.torch_compile


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flags_come_from_engine_args(command):
    parsed = build_parser().parse_args([command])
    assert engine_kwargs(parsed) == EngineArgs().kwargs()
    flags = ["--tensor-parallel-size", "2", "--dtype", "float16", "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5",
             "--sampling-mode", "vocab-parallel", "--torch-compile", "--speculative-config", '{"method": "ngram"}']
    kwargs = engine_kwargs(build_parser().parse_args([command, *flags]))
    assert kwargs == {**EngineArgs().kwargs(), "tensor_parallel_size": 2, "dtype": "float16", "max_num_seqs": 8,
                      "kv_cache_memory_gb": 0.5, "sampling_mode": "vocab-parallel", "torch_compile": True,
                      "speculative_config": '{"method": "ngram"}'}
    with pytest.raises(SystemExit):  # choices come along
        build_parser().parse_args([command, "--dtype", "float64"])


def test_bench_compare_passes_flags_serve_reads_back():
    parsed = build_parser().parse_args(["bench", "compare"])
    server = ServerOptions(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(ServerOptions)})
    assert server == ServerOptions() and server.tensor_parallel_size == 2
    custom = ServerOptions(model="m.gguf", max_num_seqs=8, max_model_len=512, kv_cache_memory_gb=0.25, seed=3,
                           sampling_mode="vocab-parallel")
    back = build_parser().parse_args(["serve", *custom.argv({"method": "ngram"})])
    for f in dataclasses.fields(ServerOptions):
        assert getattr(back, f.name) == getattr(custom, f.name), f.name
    assert back.speculative_config == '{"method": "ngram"}'


def test_unknown_engine_keyword_is_a_type_error_naming_it(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama, max_num_seq=4)


def test_kv_cache_dtype_auto_is_float16_on_cpu_with_the_kernels_and_holds_twice_the_tokens(tiny_llama):
    """"auto" resolves before any worker starts (float16 on CPU where tpspec's attention kernel
    reads it, the model's dtype otherwise); the engine's caches, the drafter's included, are in
    that dtype, and a GiB holds twice the blocks of a float32 cache."""
    from tpspec.layers import cpu_kernels

    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"no CPU kernels here: {cpu_kernels.unavailable()}")
    auto = EngineArgs(model=tiny_llama).create_engine_config("cpu")
    fp32 = EngineArgs(model=tiny_llama, kv_cache_dtype="float32").create_engine_config("cpu")
    assert (auto.cache.kv_cache_dtype, fp32.cache.kv_cache_dtype) == ("float16", "float32")
    from tpspec.layers.attention import num_kv_blocks

    assert num_kv_blocks(auto, "cpu") == 2 * num_kv_blocks(fp32, "cpu")
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}
    with LLM(tiny_llama, num_kv_blocks=32, speculative_config=spec) as llm:
        runner = llm.llm_engine.executor.runner
        assert {t.dtype for layer in runner.kv_caches for t in layer} == {torch.float16}
        assert {t.dtype for layer in runner.speculator.kv_caches for t in layer} == {torch.float16}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="float8")
