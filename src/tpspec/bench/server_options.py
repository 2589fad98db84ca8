"""The engine flags ``tpspec bench compare`` passes to each ``tpspec serve`` it starts. Kept free
of heavy imports: the CLI builds ``bench compare``'s flags from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tpspec.engine.engine_args import EngineArgs


@dataclass(frozen=True)
class ServerOptions:
    """``EngineArgs`` fields, with its defaults but TP 2 (the seed experiment's); None: the flag is
    not passed, the server's default holds."""

    model: str | None = EngineArgs.model  # None: the embedded default model
    tensor_parallel_size: int = 2
    dtype: str = EngineArgs.dtype
    device: str = EngineArgs.device
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_model_len: int | None = EngineArgs.max_model_len
    kv_cache_memory_gb: float | None = None
    num_kv_blocks: int | None = EngineArgs.num_kv_blocks
    seed: int = EngineArgs.seed
    sampling_mode: str = EngineArgs.sampling_mode  # both configs verify the same way; only drafting differs

    def argv(self, speculative_config: dict[str, Any]) -> list[str]:
        args = ["--speculative-config", json.dumps(speculative_config)]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                args += ["--" + f.name.replace("_", "-"), str(value)]
        return args
