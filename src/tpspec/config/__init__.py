"""Frozen, self-validating engine configuration, one concept a module; imports no engine part.

User errors raise ``ValueError`` naming the field, the bad value and what is allowed.
"""

from tpspec.config.cache import KV_CACHE_DTYPES, CacheConfig
from tpspec.config.engine import (
    GGUF_KERNEL_METHODS,
    INTEGER_METHODS,
    MODEL_DTYPES,
    QUANTIZATION_METHODS,
    QUANTIZATION_OPTIONS,
    SAMPLING_MODES,
    SUPPORTED_DTYPES,
    EngineConfig,
    resolve_dtype,
)
from tpspec.config.model_arch import (
    GEMMA3_LOCAL_ROPE_THETA,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    ModelArchConfig,
    read_config_json,
)
from tpspec.config.parallel import BACKENDS, DEFAULT_MASTER_PORT, ParallelConfig
from tpspec.config.scheduler import SchedulerConfig
from tpspec.config.speculative import SpeculativeConfig

__all__ = [
    "BACKENDS", "DEFAULT_MASTER_PORT", "GEMMA3_LOCAL_ROPE_THETA", "GEMMA3_SLIDING_WINDOW_PATTERN", "GGUF_KERNEL_METHODS",
    "INTEGER_METHODS", "KV_CACHE_DTYPES", "MODEL_DTYPES", "QUANTIZATION_METHODS", "QUANTIZATION_OPTIONS", "SAMPLING_MODES", "SUPPORTED_DTYPES", "CacheConfig",
    "EngineConfig", "ModelArchConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "read_config_json",
    "resolve_dtype",
]
