"""The whole engine configuration: the model, its dtype and weight format, and the parts above."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tpspec.config.cache import CacheConfig
from tpspec.config.model_arch import ModelArchConfig
from tpspec.config.parallel import ParallelConfig
from tpspec.config.scheduler import SchedulerConfig
from tpspec.config.speculative import SpeculativeConfig

MODEL_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_DTYPES = ("auto", *MODEL_DTYPES)  # "auto": resolve_dtype picks one for the device
SAMPLING_MODES = ("gathered", "vocab-parallel")
# Weight formats of ``--quantization`` (None: the weights in ``dtype``). "fp16": a float32 model's
# linear weights stored in float16 and multiplied in float32 by fbgemm (CPU; layers.cpu_weights). "q4_1":
# those weights that are exactly llama.cpp's Q4_1 (the default model's layers) kept 4-bit and
# multiplied in float32 by tpspec's kernel (CPU with AVX2; layers.q4_1), the others as "fp16". "w4a8"
# and "w4a16": those weights (and the exactly-Q8_0 ones: the default model's LM head) multiplied by
# activations rounded to 8 or 15 bits, in integer multiply-adds (layers.int8_dot), the others as
# "fp16". "w4a16-fp16": w4a16's products up to 8 rows, a float16 copy's past them (as "q4_1" does
# with its own kernel). Under these four a shipped drafter's own weights are rounded to Q4_1 first
# (its drafts are verified: lossless either way).
QUANTIZATION_METHODS = ("fp16", "q4_1", "w4a8", "w4a16", "w4a16-fp16")
GGUF_KERNEL_METHODS = ("q4_1", "w4a8", "w4a16", "w4a16-fp16")  # those that run exactly-Q4_1 weights through tpspec's kernels
INTEGER_METHODS = ("w4a16", "w4a8")  # those whose products are batch-invariant (every row count, one kernel)
QUANTIZATION_OPTIONS = ("auto", "none", *QUANTIZATION_METHODS)  # "auto": resolve_quantization picks


@dataclass(frozen=True)
class EngineConfig:
    model: str  # resolved Hugging Face–format folder
    arch: ModelArchConfig
    dtype: str = "float32"
    seed: int = 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    draft_arch: ModelArchConfig | None = None  # the draft checkpoint's shape (model-based methods)
    # "gathered": sampling and verification all-gather the target's full logits; "vocab-parallel":
    # every rank samples from its own vocab shard (sample.vocab_parallel), same tokens.
    sampling_mode: str = "gathered"
    # Decode steps run the target's decoder layers through torch.compile (models.llama): fused
    # elementwise kernels instead of ~40 dispatched ops per layer. Compiled at start-up; TP 1 only.
    torch_compile: bool = False
    quantization: str | None = None  # one of QUANTIZATION_METHODS
    # Refuse any setting in which a request's logits could depend on what shares its steps (other
    # requests, how its prompt was chunked, k, cached blocks). They cannot where every linear weight
    # runs through the integer kernels (INTEGER_METHODS; checked at load) and float32 attention through
    # the per-query CPU kernel (layers.attention, every step), with no torch.compile.
    batch_invariant: bool = False

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the verified tokens, for the drafter's own writes (the methods
        table's ``lookahead_slots``: a chain drafter writes k, DFlash its whole block of k + 1, a
        lookup none)."""
        spec = self.speculative
        return 0 if spec is None else spec.method_spec.lookahead_slots(spec.num_speculative_tokens)

    @property
    def prefix_hash_lookahead(self) -> int:
        """Tokens after a KV block that its cached KV depends on (prefix caching's block identity):
        1 when the drafter's KV at t reads token t + 1, else 0."""
        spec = self.speculative
        return int(spec is not None and spec.method_spec.kv_reads_next_token)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {MODEL_DTYPES} (resolve 'auto' with resolve_dtype), "
                             f"got {self.dtype!r}")
        if not isinstance(self.torch_compile, bool):
            raise ValueError(f"torch_compile must be True or False, got {self.torch_compile!r}")
        if self.sampling_mode not in SAMPLING_MODES:
            raise ValueError(f"sampling_mode must be one of {SAMPLING_MODES}, got {self.sampling_mode!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.quantization!r}")
        if self.quantization == "fp16" and self.dtype != "float32":
            raise ValueError(f"quantization='fp16' stores a float32 model's weights in float16 (activations stay "
                             f"float32), got dtype={self.dtype!r}; use dtype='float32', or dtype='float16' alone")
        if self.quantization in GGUF_KERNEL_METHODS and self.dtype != "float32":
            raise ValueError(f"quantization={self.quantization!r} multiplies float32 activations by a float32 model's "
                             f"Q4_1 weights, got dtype={self.dtype!r}; use dtype='float32'")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.batch_invariant and self.quantization not in INTEGER_METHODS:
            raise ValueError(f"batch_invariant needs an integer-kernel quantization {INTEGER_METHODS} (their products "
                             f"take every row count through one kernel), got quantization={self.quantization!r}")
        if self.batch_invariant and self.torch_compile:
            raise ValueError("batch_invariant and torch_compile exclude each other: compiled steps fuse their "
                             "elementwise work per batch shape")
        if self.sampling_mode == "vocab-parallel" and self.arch.vocab_size >= 2**24:
            raise ValueError(
                f"sampling_mode='vocab-parallel' needs vocab_size < 2**24 (token ids are exchanged as "
                f"float32), got vocab_size={self.arch.vocab_size}; use sampling_mode='gathered'"
            )
        tp = self.parallel.tensor_parallel_size
        a = self.arch
        if self.torch_compile and tp > 1:
            raise ValueError(
                f"torch_compile needs tensor_parallel_size=1, got {tp}: the all-reduces split each layer into "
                f"pieces that ran slower compiled than eager (benchmarks/README.md)"
            )
        # Heads are split as evenly as possible (see layers.linear.QKVParallelLinear), so a TP size
        # only has to leave every rank at least one attention head; the MLP splits evenly.
        if tp > a.num_attention_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} exceeds the model's num_attention_heads "
                f"({a.num_attention_heads}): every rank needs at least one head"
            )
        if a.intermediate_size % tp:
            allowed = [d for d in range(1, a.num_attention_heads + 1) if a.intermediate_size % d == 0]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's intermediate_size "
                f"({a.intermediate_size}); allowed sizes: {allowed}"
            )
        spec = self.speculative
        if spec is not None:
            if spec.num_speculative_tokens is None:
                raise ValueError(
                    "speculative_config.num_speculative_tokens is unresolved: build the config with "
                    "EngineArgs.create_engine_config, which reads the drafter's default (spec_decode.resolve)"
                )
            if spec.draft_tensor_parallel_size not in (None, 1, tp):
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size must be 1 or the target's "
                    f"tensor_parallel_size ({tp}), got {spec.draft_tensor_parallel_size}"
                )
            if self.draft_arch is not None and self.draft_arch.vocab_size != a.vocab_size:
                raise ValueError(
                    f"the draft model's vocab_size ({self.draft_arch.vocab_size}) differs from the target's "
                    f"({a.vocab_size}); a draft must share the target's vocabulary"
                )
            if self.draft_arch is not None and self.scheduler.max_model_len > self.draft_arch.max_position_embeddings:
                raise ValueError(
                    f"max_model_len ({self.scheduler.max_model_len}) exceeds the draft model's "
                    f"max_position_embeddings ({self.draft_arch.max_position_embeddings})"
                )
        if self.scheduler.max_model_len > a.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.scheduler.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({a.max_position_embeddings})"
            )

    def replace(self, **kw: Any) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def resolve_dtype(dtype: str, device_type: str) -> str:
    """``auto`` means float32 on CPU and bfloat16 on CUDA."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if dtype == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    return dtype
