"""Every engine option a user sets, in one frozen dataclass.

``LLM``'s keywords, ``LLMEngine.from_args`` and the engine flags of ``tpspec generate``/``serve``
(and the ones ``tpspec bench compare`` passes to its servers) are all built from ``EngineArgs``,
and its defaults are the engine configs' own (``tpspec.config``): each default lives in one place.
Kept free of heavy imports (the CLI parses with it); building the config loads what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from tpspec.config import (
    BACKENDS,
    DEFAULT_MASTER_PORT,
    GGUF_KERNEL_METHODS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    QUANTIZATION_OPTIONS,
    SAMPLING_MODES,
    SUPPORTED_DTYPES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    import torch  # lazily: the CLI parses its flags with this module

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return device


def _config_default(cls: type, name: str) -> Any:
    return next(f for f in dataclasses.fields(cls) if f.name == name).default


def _option(default: Any, help: str, type: Any = None, choices: tuple | None = None, flags: tuple[str, ...] = (),
            cli: bool = True) -> Any:
    """A field of ``EngineArgs`` with what its command-line flag needs (``type``: the flag's
    parser; flags: extra spellings; ``cli=False``: no flag)."""
    return field(default=default, metadata=dict(help=help, type=type, choices=choices, flags=flags, cli=cli))


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = _option(
        None, "a .gguf file, a Hugging Face folder or a packaged model (gemma-3-270m); default: the embedded SmolLM2-135M-Instruct", str)
    tensor_parallel_size: int = _option(
        _config_default(ParallelConfig, "tensor_parallel_size"), "ranks the model is split over", int, flags=("-tp",))
    dtype: str = _option("auto", "auto = float32 on CPU, bfloat16 on CUDA", str, SUPPORTED_DTYPES)
    device: str = _option("auto", "auto = CUDA when available", str, DEVICES)
    max_model_len: int | None = _option(
        None, "longest prompt + output (default: the model's context length, or what the KV cache holds if less)", int)
    max_num_seqs: int = _option(_config_default(SchedulerConfig, "max_num_seqs"), "most requests running at once", int)
    max_num_batched_tokens: int = _option(
        _config_default(SchedulerConfig, "max_num_batched_tokens"), "most tokens in one step (chunked prefill splits longer prompts)", int)
    block_size: int = _option(_config_default(CacheConfig, "block_size"), "tokens per KV cache block", int)
    kv_cache_memory_gb: float = _option(
        _config_default(CacheConfig, "kv_cache_memory_gb"), "KV cache size in GiB (per engine, all layers)", float)
    num_kv_blocks: int | None = _option(None, "exact number of KV blocks (overrides --kv-cache-memory-gb)", int)
    kv_cache_dtype: str = _option(
        _config_default(CacheConfig, "kv_cache_dtype"), "the dtype K and V are cached in: auto = float16 on CPU "
        "(tpspec's attention kernel widens each value exactly as it reads it: half the bytes, faster attention over "
        "long contexts and many sequences, twice the tokens per GiB), the model's dtype elsewhere", str, KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _option(
        _config_default(CacheConfig, "enable_prefix_caching"), "reuse the KV of full blocks a request shares with "
        "earlier ones (a common system prompt, a chat's history): prefilled once", bool)
    seed: int = _option(_config_default(EngineConfig, "seed"), "seed of requests that set none", int)
    enable_chunked_prefill: bool = _option(
        _config_default(SchedulerConfig, "enable_chunked_prefill"), "split long prompts over steps", cli=False)
    speculative_config: dict | str | SpeculativeConfig | None = _option(
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'', str)
    sampling_mode: str = _option(
        _config_default(EngineConfig, "sampling_mode"), "vocab-parallel: every rank samples and verifies from its own "
        "vocab shard, O(tp) bytes per row instead of O(vocab); same tokens", str, SAMPLING_MODES)
    nnodes: int = _option(_config_default(ParallelConfig, "nnodes"), "machines the TP ranks are spread over "
                          "(evenly); the others run `tpspec serve --headless`", int)
    node_rank: int = _option(_config_default(ParallelConfig, "node_rank"), "this machine's node (0 = the head)", int)
    master_addr: str = _option(_config_default(ParallelConfig, "master_addr"), "the head node's address, reachable "
                               "from every node", str)
    master_port: int | None = _option(
        None, "the head's port for the other nodes (default: a free one on one node, "
        f"{DEFAULT_MASTER_PORT} across nodes); the rendezvous also takes the next one", int)
    distributed_timeout: float = _option(
        _config_default(ParallelConfig, "distributed_timeout_s"), "seconds the head waits for the other nodes to "
        "join (and a node for the head)", float)
    distributed_backend: str = _option(
        _config_default(ParallelConfig, "backend"), "the collectives' backend (auto = gloo on CPU, NCCL on CUDA)",
        str, BACKENDS)
    torch_compile: bool = _option(
        _config_default(EngineConfig, "torch_compile"), "run decode steps through torch.compile'd decoder layers: "
        "faster on CPU; compiles at start-up (tens of seconds, cached on disk)")
    quantization: str = _option(
        "auto", "fp16 = the linear layers' weights stored in float16, multiplied in float32 (CPU, fbgemm; with --dtype "
        "float32): half the weight bytes, faster decoding; q4_1 = weights that are exactly Q4_1 (the default "
        "model's layers) kept 4-bit, the rest as fp16 (CPU with AVX2; compiles a kernel on first use): fastest for "
        "one or a few sequences; w4a16 / w4a8 = those weights and exactly-Q8_0 ones times activations rounded to 15 / "
        "8 bits in integer multiply-adds, every row count: batch-invariant (w4a8: llama.cpp's numerics, less "
        "accurate); w4a16-fp16 = w4a16 up to 8 rows, the float16 copy past them (faster than w4a16 for many "
        "sequences on AVX2-only CPUs; not batch-invariant); auto = (float32 on CPU) w4a16 with AVX-512 VNNI (or "
        "--batch-invariant), w4a16-fp16 with AVX2 only, fp16 where the kernels do not build; none = off",
        str, QUANTIZATION_OPTIONS)
    batch_invariant: bool = _option(
        _config_default(EngineConfig, "batch_invariant"), "refuse to start unless a request's tokens and logprobs "
        "cannot depend on what shares its steps (other requests, prompt chunks, speculation length, cached "
        "blocks): every linear weight in the integer kernels (w4a16, which auto then picks, or w4a8, on weights "
        "exactly Q4_1/Q8_0) and no torch.compile. Without it the same holds wherever those conditions do")

    # ---- the command line ---------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, only: tuple[str, ...] | None = None,
                     defaults: dict[str, Any] | None = None, help: dict[str, str] | None = None) -> None:
        """A flag per field (``--max-num-seqs`` for ``max_num_seqs``); ``only`` these fields, with
        ``defaults`` and ``help`` replacing the dataclass's where given."""
        defaults, help = defaults or {}, help or {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta["cli"] or (only is not None and f.name not in only):
                continue
            names = ("--" + f.name.replace("_", "-"), *meta["flags"])
            default = defaults.get(f.name, f.default)
            text = help.get(f.name, meta["help"])
            if meta["type"] is None:  # a switch, off by default
                parser.add_argument(*names, action="store_true", help=text)
            elif meta["type"] is bool:  # --name and --no-name
                parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, help=text)
            else:
                parser.add_argument(*names, type=meta["type"], default=default, choices=meta["choices"], help=text)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.metadata["cli"]})

    def kwargs(self) -> dict[str, Any]:
        """The options as ``LLM`` / ``LLMEngine.from_args`` keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ---- the engine's configuration -------------------------------------------------------------
    def create_engine_config(self, device_kind: str) -> EngineConfig:
        """The validated ``EngineConfig`` (model and drafter resolved and read, the drafter and the
        KV cache checked against the model) for ``device_kind`` ("cpu" or "cuda", from
        ``resolve_device``): everything is checked here, in the caller's process, before any worker starts."""
        from tpspec.config import ModelArchConfig, resolve_dtype
        from tpspec.layers.cpu_weights import resolve_quantization
        from tpspec.cpu_features import emulated_dtype_warning, has_fbgemm
        from tpspec.models.loader.resolve import resolve_model
        from tpspec.models.registry import get_model_class
        from tpspec.spec_decode.resolve import resolve_drafter

        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(spec)
        if self.distributed_backend == "nccl" and device_kind != "cuda":
            raise ValueError(f"distributed_backend='nccl' needs CUDA devices, got device {device_kind!r}; "
                             "use 'gloo' or 'auto' on CPU")
        dtype = resolve_dtype(self.dtype, device_kind)
        quantization = resolve_quantization(self.quantization, dtype, device_kind, self.batch_invariant)
        if quantization in QUANTIZATION_METHODS and device_kind != "cpu":
            raise ValueError(f"quantization={quantization!r} is a CPU weight format, got device {device_kind!r}; "
                             "on CUDA use --dtype float16")
        if quantization in QUANTIZATION_METHODS and not has_fbgemm():
            raise ValueError(f"quantization={quantization!r} needs fbgemm, which this torch build lacks (x86 builds "
                             "have it)")
        if quantization in GGUF_KERNEL_METHODS:
            from tpspec.layers import cpu_kernels

            reason = cpu_kernels.unavailable()
            if reason:
                raise ValueError(f"quantization={quantization!r} needs tpspec's CPU kernels, unavailable here: {reason}")
        import torch

        from tpspec.layers.attention import kv_cache_dtype, num_kv_blocks

        kv_dtype = str(kv_cache_dtype(self.kv_cache_dtype, getattr(torch, dtype), device_kind)).removeprefix("torch.")
        warning = emulated_dtype_warning(dtype) if device_kind == "cpu" else None
        if warning:
            logger.warning("%s", warning)
        folder = resolve_model(self.model)
        arch = ModelArchConfig.from_folder(folder)
        get_model_class(arch.architecture)  # an unsupported architecture fails here, before any worker starts
        draft_arch = None
        if spec is not None:
            spec, draft_arch = resolve_drafter(spec, folder, arch, self.model)
        config = EngineConfig(
            model=folder,
            arch=arch,
            dtype=dtype,
            seed=self.seed,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, backend=self.distributed_backend, nnodes=self.nnodes,
                node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
                distributed_timeout_s=self.distributed_timeout,
            ),
            cache=CacheConfig(block_size=self.block_size, num_gpu_blocks=self.num_kv_blocks,
                              kv_cache_memory_gb=self.kv_cache_memory_gb,
                              enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=kv_dtype),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len or arch.max_position_embeddings,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            speculative=spec,
            draft_arch=draft_arch,
            sampling_mode=self.sampling_mode,
            torch_compile=self.torch_compile,
            quantization=quantization,
            batch_invariant=self.batch_invariant,
        )
        num_blocks = num_kv_blocks(config, torch.device(device_kind))  # what every rank will allocate
        capacity = num_blocks * config.cache.block_size
        if capacity < config.scheduler.max_model_len:
            if self.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                    f"max_model_len={config.scheduler.max_model_len}: raise the KV cache size or lower max_model_len"
                )
            # The model's context, unless the KV cache holds less.
            logger.info("max_model_len = %d, the tokens the KV cache holds (the model's context is %d; "
                        "--kv-cache-memory-gb raises it)", capacity, arch.max_position_embeddings)
            config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_model_len=capacity))
        return config
