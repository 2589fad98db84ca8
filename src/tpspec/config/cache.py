"""The KV cache: block size, how many blocks, and whether full blocks are cached for reuse."""

from __future__ import annotations

from dataclasses import dataclass

from tpspec.config.checks import check_int

# What K and V may be cached in; "auto" is resolved per device (layers.attention.kv_cache_dtype).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks; None = derive from kv_cache_memory_gb.
    num_gpu_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    # Automatic prefix caching (engine.kv_cache): full blocks are kept by the hash of their tokens
    # and reused by later requests that start with the same tokens.
    enable_prefix_caching: bool = True
    # The dtype K and V are cached in ("auto": float16 on CPU where tpspec's attention kernel reads
    # it, else the model's; layers.attention.kv_cache_dtype).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, 1024)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.num_gpu_blocks is not None:
            check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if not (isinstance(self.kv_cache_memory_gb, (int, float)) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
