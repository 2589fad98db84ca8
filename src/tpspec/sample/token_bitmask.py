"""Token bitmasks (structured outputs): which tokens a row may take, applied to its logits.

A bitmask row holds one bit per token of the vocabulary, token t at bit ``t % 32`` of int32 word
``t // 32`` (xgrammar's layout); an unconstrained row is all ones (-1 words). Masked logits become
-inf before anything else reads them, so greedy argmax, the filters (top-k, top-p, min-p over the
allowed tokens), Gumbel-max draws, draft distributions and verification all see the masked,
renormalized distribution. Under tensor parallelism each rank applies the bits of its own columns
to its shard (``apply``): no communication, the same O(tp) bytes per row as without a grammar.
"""

from __future__ import annotations

import torch

from tpspec.sample.vocab_parallel import LogitsShard


def words_for(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


def allowed(
    bitmask: torch.Tensor,  # [rows, words] int32
    token_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:
    """Whether each row allows each token: ``[rows, n]`` bool (ids outside the bitmask: no)."""
    inside = (token_ids >= 0) & (token_ids < 32 * bitmask.shape[1])
    ids = torch.where(inside, token_ids, 0)
    words = bitmask.index_select(1, ids >> 5)  # [rows, n]
    return (((words >> (ids & 31).to(torch.int32)) & 1).bool()) & inside


_BYTE_BITS = torch.arange(8, dtype=torch.uint8)


def allowed_columns(
    bitmask: torch.Tensor,  # [rows, words] int32
    start: int,
    width: int,
) -> torch.Tensor:
    """``allowed`` for the consecutive ids ``start … start + width − 1`` (a shard's columns), by
    unpacking the bytes that hold them: ``[rows, width]`` bool. Little-endian words: token t is
    bit ``t % 8`` of byte ``t // 8``."""
    first, last = start // 8, -(-(start + width) // 8)
    data = bitmask.contiguous().view(torch.uint8)[:, first:last]  # [rows, bytes]
    if data.shape[1] < last - first:  # ids past the bitmask (shard padding): not allowed
        data = torch.nn.functional.pad(data, (0, last - first - data.shape[1]))
    bits = (data.unsqueeze(-1) >> _BYTE_BITS.to(data.device)) & 1  # [rows, bytes, 8]
    offset = start - 8 * first
    return bits.view(data.shape[0], -1)[:, offset : offset + width].bool()


def constrained_rows(bitmask: torch.Tensor) -> torch.Tensor:
    """Rows of ``bitmask`` [rows, words] that forbid some token: [n] int64."""
    return torch.nonzero((bitmask != -1).any(dim=-1)).squeeze(-1)


def apply(
    logits: torch.Tensor | LogitsShard,  # [rows, vocab] gathered, or this rank's [rows, shard_size] columns
    bitmask: torch.Tensor | None,  # [rows, words] int32; None: no row constrained
    column_ids: torch.Tensor | None = None,  # [columns] int64 token id of each column (default: its index)
    argmax_only: torch.Tensor | bool | None = None,  # [rows] bool: rows read only through their argmax (True: all)
) -> None:
    """Forbidden tokens' logits to -inf, in place. A shard's columns are ids ``vocab_start …``;
    ``column_ids`` maps columns to other ids (EAGLE-3's draft vocabulary to the target's).

    ``argmax_only`` (gathered logits): rows whose only use is their argmax (greedy rows without
    logprobs, greedy drafts) are left unmasked when their argmax is allowed, which is then also the
    masked row's argmax (ties included: the lowest id among the maxima is allowed). Masking a row
    costs a pass over the vocabulary (about 0.5 ms at 262,144 on this machine kind); the check, one
    argmax."""
    if bitmask is None:
        return
    rows = constrained_rows(bitmask)
    if rows.numel() == 0:
        return
    values = logits.logits if isinstance(logits, LogitsShard) else logits
    if argmax_only is not None and not isinstance(logits, LogitsShard):
        if argmax_only is True:
            argmax_only = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
        greedy = argmax_only.index_select(0, rows)
        if bool(greedy.any()):
            best = values.index_select(0, rows).argmax(dim=-1) if rows.numel() < values.shape[0] else values.argmax(dim=-1)
            if column_ids is not None:
                best = column_ids.index_select(0, best)
            word = bitmask.index_select(0, rows).gather(1, (best >> 5).unsqueeze(-1)).squeeze(-1)
            kept = ((word >> (best & 31).to(torch.int32)) & 1).bool()
            rows = rows[~(greedy & kept)]
            if rows.numel() == 0:
                return
    if column_ids is None:
        start = logits.vocab_start if isinstance(logits, LogitsShard) else 0
        ok = allowed_columns(bitmask.index_select(0, rows), start, values.shape[-1])
    else:
        ok = allowed(bitmask.index_select(0, rows), column_ids)
    values.index_copy_(0, rows, values.index_select(0, rows).masked_fill_(~ok, float("-inf")))
