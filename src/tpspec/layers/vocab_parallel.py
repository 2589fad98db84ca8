"""Vocabulary-sharded embedding and LM head.

The vocabulary is padded to a multiple of 64 and split evenly: rank r owns padded ids
``[r·V_p/tp, (r+1)·V_p/tp)``; padding rows (ids ≥ vocab_size) sit on the last shard(s) and are
zero in the embedding and never sampled from the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.cpu_weights import PackedCPUWeight
from tpspec.layers.partition import pad_vocab


class VocabParallelEmbedding(nn.Module):
    """E[x], E split along the vocab dim; out-of-shard ids give 0 and one all-reduce sums the rows."""

    def __init__(self, vocab_size: int, embedding_dim: int, dtype=torch.float32):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab(vocab_size, self.tp_size)
        self.shard_size = self.padded_vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = self.vocab_start + self.shard_size
        # Number of real (non-padding) rows in this shard.
        self.num_real = max(0, min(self.vocab_end, vocab_size) - self.vocab_start)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if self.num_real:
            param.data[: self.num_real].copy_(loaded[self.vocab_start : self.vocab_start + self.num_real])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # input_ids: [num_tokens]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = F.embedding((input_ids - self.vocab_start).masked_fill(mask, 0), self.weight)
        local.masked_fill_(mask.unsqueeze(-1), 0)
        return comm.all_reduce(local, "embed.all_reduce")  # [num_tokens, embedding_dim]


class ParallelLMHead(PackedCPUWeight, VocabParallelEmbedding):
    """Logits = H·Wᵀ, W split along the vocab dim (each rank computes its shard of the logits)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> this shard's raw logits [num_rows, shard_size]."""
        return self.linear(hidden)
