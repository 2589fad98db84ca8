"""Runs the model on one rank: builds a step's tensors, runs the forward, samples.

Every rank runs this on the same inputs (SPMD); sampling uses the gathered logits and
counter-based noise, so every rank computes the same tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from tpspec.config import EngineConfig
from tpspec.distributed.parallel_state import get_tp_rank
from tpspec.layers.attention import AttentionMetadata
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.registry import get_model_class
from tpspec.sample.sampler import Sampler, SamplingMetadata
from tpspec.worker.step import StepInput, StepOutput, TokenLogprobs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def num_kv_blocks(config: EngineConfig) -> int:
    """Blocks that fit the KV budget, computed from the whole model so every rank agrees."""
    if config.cache.num_gpu_blocks is not None:
        return config.cache.num_gpu_blocks
    a = config.arch
    elem = torch.empty(0, dtype=DTYPES[config.dtype]).element_size()
    per_block = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * config.cache.block_size * elem
    return max(1, int(config.cache.kv_cache_memory_gb * (1 << 30)) // per_block)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        self.sampler = Sampler()

    def load_model(self) -> None:
        t0 = time.perf_counter()
        cls = get_model_class(self.config.arch.architecture)
        with torch.device(self.device):
            self.model = cls(self.config.arch, self.dtype)
        loaded = self.model.load_weights(iterate_weights(self.config.model, show_progress=get_tp_rank() == 0))
        missing = {n for n, _ in self.model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint {self.config.model!r} lacks weights: {sorted(missing)[:5]}")
        self.model.eval()
        self.num_blocks = num_kv_blocks(self.config)
        kv_heads, head_dim = self.model.kv_cache_shape
        slots = self.num_blocks * self.block_size
        self.kv_caches = [
            (
                torch.zeros(slots, kv_heads, head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(slots, kv_heads, head_dim, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.config.arch.num_hidden_layers)
        ]
        logger.info(
            "rank %d: loaded %d tensors (%d local parameters) in %.1f s; KV cache %d blocks of %d tokens",
            get_tp_rank(), len(loaded), sum(p.numel() for p in self.model.parameters()),
            time.perf_counter() - t0, self.num_blocks, self.block_size,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        seqs = step.seqs
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in seqs])
        query_lens = [len(s.token_ids) for s in seqs]
        md = AttentionMetadata.build(
            query_lens,
            [s.start_pos + len(s.token_ids) for s in seqs],
            [s.block_table for s in seqs],
            self.block_size,
            self.device,
        )
        hidden, _ = self.model(input_ids.to(self.device), positions.to(self.device), self.kv_caches, md)
        ends = torch.cumsum(torch.tensor(query_lens), 0) - 1
        rows = [i for i, s in enumerate(seqs) if s.sample]
        sampled: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if not rows:
            return StepOutput(sampled, logprobs)
        logits = self.model.compute_logits(hidden[ends[rows].to(self.device)])  # [num_rows, vocab_size]
        meta = SamplingMetadata.from_params(
            [seqs[i].params for i in rows],
            [seqs[i].seed for i in rows],
            [seqs[i].start_pos + len(seqs[i].token_ids) for i in rows],
        )
        out = self.sampler(logits, meta)
        tokens = out.sampled_token_ids.tolist()
        for j, i in enumerate(rows):
            sampled[i] = tokens[j]
        if out.logprobs is not None:
            lp = out.logprobs
            tok_lp = lp.token_logprob.tolist()
            top_ids, top_lp = lp.topk_token_ids.tolist(), lp.topk_logprobs.tolist()
            for j, i in enumerate(rows):
                n = seqs[i].params.logprobs
                if n is not None:
                    logprobs[i] = TokenLogprobs(tok_lp[j], list(zip(top_ids[j][:n], top_lp[j][:n])))
        return StepOutput(sampled, logprobs)
