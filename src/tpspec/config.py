"""Frozen, self-validating engine configuration.

User errors raise ``ValueError`` naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from tpspec.spec_decode.shipped import METHOD_ALIASES, SHIPPED_DRAFTERS

MODEL_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_DTYPES = ("auto", *MODEL_DTYPES)  # "auto": resolve_dtype picks one for the device
SAMPLING_MODES = ("gathered", "vocab-parallel")
# Weight formats of ``--quantization`` (None: the weights in ``dtype``). "fp16": a float32 model's
# linear weights stored in float16 and multiplied in float32 by fbgemm (CPU; layers.linear). "q4_1":
# those weights that are exactly llama.cpp's Q4_1 (the default model's layers) kept 4-bit and
# multiplied in float32 by tpspec's kernel (CPU with AVX2; layers.q4_1), the others as "fp16";
# a shipped drafter's own weights are rounded to Q4_1 first (its drafts are verified: lossless either way).
QUANTIZATION_METHODS = ("fp16", "q4_1")
QUANTIZATION_OPTIONS = ("auto", "none", *QUANTIZATION_METHODS)  # "auto": resolve_quantization picks
BACKENDS = ("auto", "gloo", "nccl")


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def read_config_json(folder: str, what: str) -> dict:
    """``folder/config.json`` as a dict; ``what`` names the folder in the error (e.g. "DFlash checkpoint")."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {folder!r} has no config.json")
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelArchConfig:
    """The decoder's shape, read from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Gemma 3 (None / defaults elsewhere): per layer "sliding_attention" or "full_attention", the
    # window of the sliding layers and their RoPE base, the score scale's 1/√ argument, the
    # final logits' tanh soft cap, and the MLP's activation.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # MTP modules stored after the decoder layers (model.layers.{N + i}): the target skips them
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", ""), str(cfg.get("model_type")))
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        # transformers 5 keeps RoPE per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
        local_rope = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention", rope)
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            **_gemma3_fields(cfg, arch, local_rope),
        )

    @classmethod
    def from_folder(cls, folder: str) -> "ModelArchConfig":
        return cls.from_hf_config(read_config_json(folder, "model folder"))


_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma 3 configs that list no layer_types: every sliding_window_pattern-th layer is global; the
# sliding layers' RoPE base where a config gives none (also what llama.cpp uses for GGUF files).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma3_fields(cfg: dict, arch: str, local_rope: dict) -> dict:
    """ModelArchConfig's Gemma 3 fields from a Hugging Face config (none for other architectures)."""
    if arch != "Gemma3ForCausalLM":
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({layers}), got {types!r}")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 configs leave it null)")
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        layer_types=tuple(types),
        sliding_window=int(cfg["sliding_window"]),
        rope_local_theta=float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_activation=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
    )


# vLLM's default --master-port: where the head of a multi-node engine listens when none is given.
DEFAULT_MASTER_PORT = 29501


@dataclass(frozen=True)
class ParallelConfig:
    """The TP group: its size and, across machines (vLLM's multi-node flags), how its nodes meet.

    The ``tensor_parallel_size`` ranks are spread evenly over ``nnodes`` nodes: node r runs ranks
    ``r·n … r·n + n − 1`` with ``n = tensor_parallel_size / nnodes``; node 0 (the head) runs the
    engine and rank 0. Across nodes the head listens on ``master_addr:master_port`` for the other
    nodes and the torch.distributed rendezvous is on ``master_port + 1``.
    """

    tensor_parallel_size: int = 1
    backend: str = "auto"  # BACKENDS
    worker_timeout_s: float = 600.0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free loopback port on one node, DEFAULT_MASTER_PORT across nodes
    distributed_timeout_s: float = 300.0  # the longest the head waits for the other nodes to join

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        _check_int("nnodes", self.nnodes, 1, 64)
        _check_int("node_rank", self.node_rank, 0)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes - 1] = [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not divisible by nnodes={self.nnodes}: "
                "the ranks are spread evenly over the nodes"
            )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, 1, 65534)  # the rendezvous takes master_port + 1
        if isinstance(self.distributed_timeout_s, bool) or not (
            isinstance(self.distributed_timeout_s, (int, float)) and self.distributed_timeout_s > 0
        ):
            raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got {self.distributed_timeout_s!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_ranks(self, node_rank: int | None = None) -> range:
        """The global TP ranks that run on ``node_rank`` (default: this node)."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks; None = derive from kv_cache_memory_gb.
    num_gpu_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if not (isinstance(self.kv_cache_memory_gb, (int, float)) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )


SPEC_METHODS = ("draft_model", "ngram", "dflash", "eagle3", "eagle", "mtp")
# Methods whose model may be omitted: they fall back to the drafter shipped for the target, and
# mtp (as in vLLM) to the target's own checkpoint, whose MTP layers follow its decoder layers.
SHIPPED_DRAFTER_METHODS = (*SHIPPED_DRAFTERS, *METHOD_ALIASES)
MODEL_OPTIONAL_METHODS = (*SHIPPED_DRAFTER_METHODS, "mtp")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: JSON keys named as in vLLM."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft checkpoint (.gguf or folder) for model-based methods
    use_local_argmax_reduction: bool = False
    draft_sample_method: str = "greedy"
    draft_tensor_parallel_size: int | None = None  # None = the target's
    prompt_lookup_min: int | None = None  # ngram
    prompt_lookup_max: int | None = None  # ngram
    # True: num_speculative_tokens is the most drafts a request verifies per step and the engine
    # chooses how many (spec_decode.controller); false: always num_speculative_tokens (vLLM's
    # behaviour). None (unset): adaptive unless a per-batch-size schedule is given.
    adaptive: bool | None = None
    # vLLM's static schedule: ``[start, end, k]`` rows, batch sizes start..end (inclusive) speculate k
    # tokens (0: none); other batch sizes speculate num_speculative_tokens.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        self._validate_speculation_length()
        for key in ("use_local_argmax_reduction",):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"speculative_config.{key} must be true or false, got {getattr(self, key)!r}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path string, got {self.model!r}")
        if self.draft_tensor_parallel_size is not None:
            _check_int("speculative_config.draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1, 64)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(
                    f"speculative_config.model must not be set for method 'ngram' (it uses no model), "
                    f"got {self.model!r}"
                )
            if self.draft_tensor_parallel_size is not None:
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size only applies to a draft model; method 'ngram' "
                    f"has none, got {self.draft_tensor_parallel_size}"
                )
            if self.use_local_argmax_reduction:
                raise ValueError(
                    "speculative_config.use_local_argmax_reduction=true needs a draft model's LM head; "
                    "method 'ngram' has no model"
                )
            if self.draft_sample_method != "greedy":
                raise ValueError(
                    f"speculative_config.draft_sample_method must be 'greedy' for method 'ngram', "
                    f"got {self.draft_sample_method!r}"
                )
            lo = 2 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(lo, 4) if self.prompt_lookup_max is None else self.prompt_lookup_max
            _check_int("speculative_config.prompt_lookup_min", lo, 1, 64)
            _check_int("speculative_config.prompt_lookup_max", hi, 1, 64)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if self.model is None and self.method not in MODEL_OPTIONAL_METHODS:
                raise ValueError(
                    f"speculative_config.model is required for method {self.method!r} (a draft checkpoint: "
                    f"a .gguf file or a model folder), got None"
                )
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"speculative_config.{key} only applies to method 'ngram', got {getattr(self, key)!r} "
                        f"with method {self.method!r}"
                    )

    def _validate_speculation_length(self) -> None:
        schedule = self.num_speculative_tokens_per_batch_size
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if schedule is None:
            object.__setattr__(self, "adaptive", self.adaptive is not False)
            return
        key = "speculative_config.num_speculative_tokens_per_batch_size"
        if self.adaptive:
            raise ValueError(f"{key} is a static schedule: it cannot be combined with speculative_config.adaptive=true")
        if not isinstance(schedule, (list, tuple)) or not schedule:
            raise ValueError(f"{key} must be a non-empty list of [start, end, k] rows, got {schedule!r}")
        rows = []
        for row in schedule:
            if not isinstance(row, (list, tuple)) or len(row) != 3:
                raise ValueError(f"{key} rows must be [start, end, k], got {row!r}")
            start, end, k = row
            _check_int(f"{key} start", start, 1)
            _check_int(f"{key} end", end, start)
            _check_int(f"{key} k", k, 0, self.num_speculative_tokens)
            rows.append((start, end, k))
        rows.sort()
        for (_, end, _), (start, _, _) in zip(rows, rows[1:]):
            if start <= end:
                raise ValueError(f"{key} rows overlap at batch size {start}: {schedule!r}")
        object.__setattr__(self, "num_speculative_tokens_per_batch_size", tuple(rows))
        object.__setattr__(self, "adaptive", False)

    def k_for_batch_size(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` requests when k is not adaptive."""
        for start, end, k in self.num_speculative_tokens_per_batch_size or ():
            if start <= batch_size <= end:
                return k
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, d: "dict | str") -> "SpeculativeConfig":
        """From a dict or a JSON string; unknown keys and wrong types raise ``ValueError``."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**d)


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

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the verified tokens, for the drafter's own writes: a chain
        drafter writes k (the bonus token and k − 1 drafts), DFlash its whole block of k + 1
        (the bonus token and k masks); ngram proposes on the driver and writes none."""
        spec = self.speculative
        if spec is None or spec.method == "ngram":
            return 0
        return spec.num_speculative_tokens + (spec.method == "dflash")

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
        if self.quantization == "q4_1" and self.dtype != "float32":
            raise ValueError(f"quantization='q4_1' multiplies float32 activations by a float32 model's Q4_1 weights, "
                             f"got dtype={self.dtype!r}; use dtype='float32'")
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


def resolve_quantization(quantization: str | None, dtype: str, device_type: str) -> str | None:
    """``auto`` means, for a float32 model on a CPU whose torch has fbgemm, "q4_1" where tpspec's
    CPU kernels build (AVX2, FMA, F16C and a C++ compiler; ``layers.cpu_kernels``), else "fp16";
    elsewhere None. "q4_1" keeps weights that are exactly Q4_1 (the default model's layers) 4-bit
    and multiplies them exactly (up to summation order) up to 8 rows a product, through the "fp16"
    copy past that, so it is never further from float32 than "fp16": on the default model it decoded
    one sequence 1.25-1.31x as fast as "fp16" on an AVX2 CPU, and "fp16" 1.86x as fast as float32
    weights (benchmarks/README.md: CPU kernels; float16 weights). The bound either is held to:
    at least 28 of 32 greedy 64-token HumanEval sequences identical to float32's and chosen-token
    logprobs within 0.05 nats (``benchmarks/dtype_agreement.py``). ``none`` (or None): off."""
    if quantization is not None and quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_OPTIONS}, got {quantization!r}")
    if quantization == "auto":
        from tpspec.cpu_features import has_fbgemm

        if device_type != "cpu" or dtype != "float32" or not has_fbgemm():
            return None
        from tpspec.layers import cpu_kernels

        return "q4_1" if cpu_kernels.unavailable() is None else "fp16"
    return None if quantization == "none" else quantization


def resolve_dtype(dtype: str, device_type: str) -> str:
    """``auto`` means float32 on CPU and bfloat16 on CUDA."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if dtype == "auto":
        return "float32" if device_type == "cpu" else "bfloat16"
    return dtype
