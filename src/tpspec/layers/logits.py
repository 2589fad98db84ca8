"""From hidden states to logits over the full (unpadded) vocabulary, to this rank's shard of them
(``compute_logits_shard``, no communication, for ``sample.vocab_parallel``), or straight to the
greedy token with O(tp) communication (``get_top_tokens``)."""

from __future__ import annotations

import torch

from tpspec.distributed import comm
from tpspec.layers.vocab_parallel import ParallelLMHead
from tpspec.sample import token_bitmask, vocab_parallel
from tpspec.sample.vocab_parallel import LogitsShard

# Token ids travel as float32 next to their logit in get_top_tokens; float32 holds every integer
# below 2**24 exactly, and no id at or above it.
MAX_LOCAL_ARGMAX_VOCAB = 2**24


def check_local_argmax_vocab(vocab_size: int) -> None:
    """Raise ValueError if ``vocab_size`` is too large for ``get_top_tokens`` (float32 ids)."""
    if vocab_size >= MAX_LOCAL_ARGMAX_VOCAB:
        raise ValueError(
            f"get_top_tokens (use_local_argmax_reduction) needs vocab_size < 2**24 = "
            f"{MAX_LOCAL_ARGMAX_VOCAB} (token ids are exchanged as float32), got vocab_size={vocab_size}"
        )


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap) (Gemma's final-logit soft cap); the logits unchanged for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


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
        logits = soft_cap(lm_head.local_logits(hidden).float(), self.soft_cap)
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def compute_logits(self, lm_head: ParallelLMHead, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size]: one all-gather of every shard."""
        logits = comm.all_gather(self.local_logits(lm_head, hidden), site, dim=-1)
        return logits[:, : self.vocab_size]

    def compute_logits_shard(self, lm_head: ParallelLMHead, hidden: torch.Tensor) -> LogitsShard:
        """hidden: [num_rows, hidden_size] -> this rank's transformed float32 shard of the logits,
        ``[num_rows, shard_size]``, padding columns (ids >= vocab_size) masked to -inf. No communication."""
        logits = self.local_logits(lm_head, hidden)  # [num_rows, shard_size] float32
        num_real = max(0, min(self.vocab_size - lm_head.vocab_start, logits.shape[-1]))
        if num_real < logits.shape[-1]:
            logits[:, num_real:] = float("-inf")  # padding columns never win
        return LogitsShard(logits, lm_head.vocab_start, self.vocab_size)

    def get_top_tokens(
        self, lm_head: ParallelLMHead, hidden: torch.Tensor, site: str = "draft.sample",
        bitmask: torch.Tensor | None = None, column_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> greedy token ids [num_rows] (int64), equal to
        ``compute_logits(lm_head, hidden).argmax(-1)`` on every rank, with O(tp) communication.

        Each rank takes the argmax of its own (transformed, float32) shard logits, padding columns
        masked to -inf; one all-gather of packed ``[num_rows, 2]`` float32 (value, global id) pairs
        then picks, per row, the highest value, ties to the lowest rank (``vocab_parallel.argmax``).
        ``torch.argmax`` returns the first maximal index (documented), so within a shard ties go to
        the lowest local id, and since shards are ordered by id, the lowest rank holds the lowest
        global id: the same token the full-vocabulary argmax picks. NaN: ``torch.argmax`` ranks NaN
        above everything (first NaN wins), locally and across ranks alike, so a row with NaN logits
        also gets the full argmax's answer (the first NaN's id). Only a shard whose columns are all
        -inf or padding can report a padding id, and then rank 0 (always real columns) wins the tie.
        Gathered bytes: 8·tp per row (none at TP 1).

        ``bitmask`` ([num_rows, words] int32, structured outputs): each rank masks its own columns
        first (no communication), so the argmax is over the allowed tokens. ``column_ids``
        ([vocab_size] int64): the token id each vocabulary entry stands for in the bitmask, when
        it is not the entry's own index (EAGLE-3's draft vocabulary).
        """
        check_local_argmax_vocab(self.vocab_size)
        shard = self.compute_logits_shard(lm_head, hidden)
        if bitmask is not None:
            ids = None
            if column_ids is not None:  # this shard's entries; padding columns stand for no token
                ids = torch.full((shard.shard_size,), -1, dtype=torch.int64, device=column_ids.device)
                mine = column_ids[shard.vocab_start : shard.vocab_start + shard.shard_size]
                ids[: mine.shape[0]] = mine
            token_bitmask.apply(shard, bitmask, ids)
        return vocab_parallel.argmax(shard, site)
