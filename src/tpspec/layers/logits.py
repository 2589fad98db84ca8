"""From hidden states to logits over the full (unpadded) vocabulary."""

from __future__ import annotations

import torch

from tpspec.distributed import comm
from tpspec.layers.vocab_parallel import ParallelLMHead


class LogitsProcessor:
    """Applies the LM head, then the model's logit transforms (scale, soft-cap), identically on
    every path that turns hidden states into token decisions."""

    def __init__(self, vocab_size: int, scale: float = 1.0, soft_cap: float | None = None):
        if not scale > 0:
            raise ValueError(f"logit scale must be > 0, got {scale}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"logit soft_cap must be > 0 or None, got {soft_cap}")
        self.vocab_size = vocab_size
        self.scale = scale
        self.soft_cap = soft_cap

    def local_logits(self, lm_head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> transformed shard logits [num_rows, shard_size] (float32)."""
        logits = lm_head.local_logits(hidden).float()
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def compute_logits(self, lm_head: ParallelLMHead, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size]: one all-gather of every shard."""
        logits = comm.all_gather(self.local_logits(lm_head, hidden), site, dim=-1)
        return logits[:, : self.vocab_size]
