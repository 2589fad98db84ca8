"""Sampling on a vocabulary-sharded row: each rank reduces its own columns of the logits and only
O(tp) numbers per row cross the wire (O(c·tp) for top-k / top-p candidates), never O(vocab).

Rank r holds a ``LogitsShard``: columns ``[vocab_start, vocab_start + shard_size)`` of the logits,
as the LM head's local matmul gives them, with padding columns (ids >= vocab_size) at -inf. Each
primitive makes one packed all-gather per call (the filters: see ``apply_top_k_top_p_min_p``);
every rank derives the same answer from the same gathered numbers.

Exactness, against the same computation on the gathered row (``sample.sampler``):
  * argmax and Gumbel-max: identical. ``torch.argmax`` takes the first maximum within a shard and,
    across shards, the lowest rank (which holds the lowest ids) wins a tie: ties go to the lowest
    global id. The noise is ``gumbel(seed, position, global id, stream)`` for the shard's own ids.
  * top-k, top-p, min-p: identical (the k-th largest value of the union of every shard's top k is
    the row's k-th largest; top-p is decided on the exact integer masses of ``sample.mass``).
  * logsumexp and logprobs: combined from per-shard (max, Σ exp(x − max)) float32 pairs, equal to
    ``torch.logsumexp`` / ``log_softmax`` of the gathered row up to float rounding (a few ulps; at
    TP 1 bit for bit). They are reported values, never used for a decision.
Token ids travel as float32 next to their values: exact below 2^24 (``check_local_argmax_vocab``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_size
from tpspec.sample.gumbel import SAMPLE, gumbel
from tpspec.sample.mass import masses, reached
from tpspec.sample.sampler import (
    SampledLogprobs,
    SamplingMetadata,
    order_key,
    top_n,
    top_p_threshold,
)

# Top-p candidates per shard and row. A row whose nucleus they do not settle (a flat
# distribution) is resolved by the histogram search of ``_radix_top_p_threshold``.
TOP_P_CANDIDATES = 64
_RADIX_BITS = 8  # histogram search: 32-bit keys, 8 bits (256 buckets) per all-reduce


@dataclass(frozen=True)
class LogitsShard:
    """This rank's columns of a batch of logits rows."""

    logits: torch.Tensor  # [rows, shard_size] float32, padding columns (ids >= vocab_size) -inf
    vocab_start: int  # global id of column 0
    vocab_size: int  # real (unpadded) vocabulary size of the whole row

    @property
    def shard_size(self) -> int:
        return self.logits.shape[-1]

    def token_ids(self) -> torch.Tensor:
        """Global ids of the columns, ``[shard_size]`` int64."""
        return torch.arange(
            self.vocab_start, self.vocab_start + self.shard_size, dtype=torch.int64, device=self.logits.device
        )

    def replace(self, logits: torch.Tensor) -> "LogitsShard":
        return dataclasses.replace(self, logits=logits)

    def select(self, rows: torch.Tensor) -> "LogitsShard":
        """The given rows (``[n]`` int64 indices)."""
        return self.replace(self.logits.index_select(0, rows))


def shard_columns(
    full: torch.Tensor,  # [rows, n] full-width rows (n = vocab_size, or padded)
    vocab_start: int,
    shard_size: int,
    fill: float,
) -> torch.Tensor:
    """Columns ``[vocab_start, vocab_start + shard_size)`` of ``full``, ``fill`` past its end: ``[rows, shard_size]``."""
    part = full[:, vocab_start : vocab_start + shard_size]
    missing = shard_size - part.shape[-1]
    return F.pad(part, (0, missing), value=fill) if missing else part


# ---- packing: one all-gather of [rows, columns] float32 --------------------------------------------
def gather_packed(packed: torch.Tensor, site: str) -> torch.Tensor:
    """Every rank's ``[rows, c]`` float32 pack, in one all-gather: ``[tp, rows, c]``."""
    return comm.all_gather(packed, site, dim=0).view(-1, *packed.shape)


def gather_columns(columns: list[torch.Tensor], site: str) -> torch.Tensor:
    """Every rank's ``[rows]`` float32 columns, in one all-gather: ``[tp, rows, len(columns)]``."""
    return gather_packed(torch.stack(columns, dim=-1), site)


def local_best(
    x: torch.Tensor,  # [rows, shard_size] float32
    vocab_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's (max value, its global id) per row, ``[rows]`` float32 and ``[rows]`` int64;
    the first maximum (lowest id) on ties."""
    local = x.argmax(dim=-1, keepdim=True)  # [rows, 1]
    return x.gather(-1, local).squeeze(-1), local.squeeze(-1) + vocab_start


def best_of(
    values: torch.Tensor,  # [tp, rows] float32, each rank's local best value
    ids: torch.Tensor,  # [tp, rows] float32, its global id
) -> torch.Tensor:
    """The id of the highest value per row, ties to the lowest rank: ``[rows]`` int64."""
    winner = values.argmax(dim=0, keepdim=True)  # [1, rows]
    return ids.gather(0, winner).squeeze(0).long()


def owned_values(
    x: torch.Tensor,  # [rows, shard_size]
    vocab_start: int,
    token_ids: torch.Tensor,  # [rows, n] int64 global ids
) -> torch.Tensor:
    """``x`` at the given tokens where this shard holds them, -inf elsewhere: ``[rows, n]``. The
    maximum over ranks is the value at the token, exactly (one rank holds each id)."""
    local = token_ids - vocab_start
    own = (local >= 0) & (local < x.shape[-1])
    return x.gather(-1, local.clamp(0, x.shape[-1] - 1)).masked_fill(~own, -math.inf)


def _local_lse_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, s) = (max x, Σ exp(x − m)) per row, ``[rows]`` each; an all -inf row gives (-inf, 0)."""
    m = x.amax(dim=-1)  # [rows]
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(x - shift.unsqueeze(-1)).sum(dim=-1)


def _combine_lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """logsumexp from per-rank pairs ``[tp, rows]``: M + log Σ_r s_r·exp(m_r − M), ``[rows]``."""
    top = m.amax(dim=0)  # [rows]
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    return shift + torch.log((s * torch.exp(m - shift)).sum(dim=0))


# ---- primitives ----------------------------------------------------------------------------------
def argmax(shard: LogitsShard, site: str) -> torch.Tensor:
    """argmax_x l(x), ties to the lowest id, ``[rows]`` int64: one all-gather of (value, id),
    8·tp bytes per row (none at TP 1)."""
    value, gid = local_best(shard.logits, shard.vocab_start)
    if get_tp_size() == 1 or gid.numel() == 0:
        return gid
    g = gather_columns([value, gid.float()], site)  # [tp, rows, 2]
    return best_of(g[..., 0], g[..., 1])


def gumbel_max(
    shard: LogitsShard,
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    stream: int,
    site: str,
) -> torch.Tensor:
    """argmax_x (l(x) + gumbel(seed, position, x, stream)), a draw from softmax(l), ``[rows]``
    int64: noise for the shard's own ids, then ``argmax`` (8·tp bytes per row)."""
    noisy = gumbel(seeds, positions, shard.token_ids(), stream).add_(shard.logits)  # [rows, shard_size]
    return argmax(shard.replace(noisy), site)


def logsumexp(shard: LogitsShard, site: str) -> torch.Tensor:
    """log Σ_x exp l(x) ``[rows]`` float32, from per-shard (max, Σ exp(x − max)): 8·tp bytes per row."""
    m, s = _local_lse_pair(shard.logits)
    g = gather_columns([m, s], site)  # [tp, rows, 2]
    return _combine_lse(g[..., 0], g[..., 1])


def token_logprobs(
    shard: LogitsShard,
    token_ids: torch.Tensor,  # [rows, n] int64
    site: str,
) -> torch.Tensor:
    """log p(x) = l(x) − logsumexp(l) at the given tokens ``[rows, n]``: the logsumexp pairs and
    each token's value (from the rank holding it) in one all-gather, (2 + n)·4·tp bytes per row."""
    m, s = _local_lse_pair(shard.logits)
    values = owned_values(shard.logits, shard.vocab_start, token_ids)  # [rows, n]
    g = gather_columns([m, s, *values.unbind(-1)], site)  # [tp, rows, 2 + n]
    return g[..., 2:].amax(dim=0) - _combine_lse(g[..., 0], g[..., 1]).unsqueeze(-1)


def logprobs_of(
    shard: LogitsShard,  # raw logits
    token_ids: torch.Tensor,  # [rows] int64
    n: int,
    site: str,
) -> SampledLogprobs:
    """``sampler.logprobs_of`` on a sharded row: log p at ``token_ids`` and the top n tokens by
    logit (ties to the lowest id) with their logprobs. One all-gather of the logsumexp pairs, the
    token's value and each shard's top n (value, id): (3 + 2n)·4·tp bytes per row."""
    n = min(n, shard.vocab_size)
    m, s = _local_lse_pair(shard.logits)
    value = owned_values(shard.logits, shard.vocab_start, token_ids.unsqueeze(-1)).squeeze(-1)
    n_local = min(n, shard.shard_size)
    top_values, top_ids = top_n(shard.logits, n_local)  # [rows, n_local], local ids
    top_ids = (top_ids + shard.vocab_start).float()
    g = gather_columns([m, s, value, *top_values.unbind(-1), *top_ids.unbind(-1)], site)
    lse = _combine_lse(g[..., 0], g[..., 1])  # [rows]
    rows = g.shape[1]
    cand_values = g[..., 3 : 3 + n_local].permute(1, 0, 2).reshape(rows, -1)  # [rows, tp·n_local]
    cand_ids = g[..., 3 + n_local :].permute(1, 0, 2).reshape(rows, -1).long()
    by_id = cand_ids.argsort(dim=-1)  # equal values keep the lowest id first below
    cand_values, cand_ids = cand_values.gather(-1, by_id), cand_ids.gather(-1, by_id)
    order = cand_values.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    return SampledLogprobs(
        token_logprob=g[..., 2].amax(dim=0) - lse,
        topk_logprobs=cand_values.gather(-1, order) - lse.unsqueeze(-1),
        topk_token_ids=cand_ids.gather(-1, order),
    )


# ---- filters ------------------------------------------------------------------------------------
def _local_top(x: torch.Tensor, c: int) -> torch.Tensor:
    """Each row's c largest values, descending, -inf past the shard's end: ``[rows, c]``."""
    top = torch.topk(x, min(c, x.shape[-1]), dim=-1).values
    return F.pad(top, (0, c - top.shape[-1]), value=-math.inf)


def apply_top_k_top_p_min_p(
    shard: LogitsShard,  # temperature already applied
    top_k: torch.Tensor,  # [rows] int64, 0 = off
    top_p: torch.Tensor,  # [rows] float32, 1 = off
    min_p: torch.Tensor,  # [rows] float32, 0 = off
    site: str,
) -> tuple[LogitsShard, torch.Tensor | None]:
    """``sampler.apply_top_k_top_p_min_p`` on a sharded row, masked entries -inf, and the row
    maximum ``[rows]`` (None unless every row uses a filter; rows that use none exchange nothing).

    One all-gather of each shard's c best values per row (c = the largest top-k, at least
    ``TOP_P_CANDIDATES`` with top-p, 1 for min-p alone) gives the row maximum (min-p's floor) and
    top-k's k-th value. Top-p then all-reduces the row's total mass Z (8 bytes per row) and walks
    the sorted candidates; its threshold t is settled when the cumulative mass reaches top_p·Z at
    a value above every shard's c-th candidate (then every token >= t is a candidate), else by
    ``_radix_top_p_threshold``. Same thresholds as the gathered filters, bit for bit.
    """
    x = shard.logits  # [rows, shard_size]
    rows = x.shape[0]
    k = top_k.clamp(min=0, max=shard.vocab_size)
    min_on = min_p > 0
    active = torch.nonzero((k > 0) | (top_p < 1.0) | min_on).squeeze(-1)
    if active.numel() == 0:
        return shard, None
    if active.numel() < rows:  # exchange nothing for the unfiltered rows (their maximum stays unknown)
        part, _ = apply_top_k_top_p_min_p(shard.select(active), k[active], top_p[active], min_p[active], site)
        return shard.replace(x.index_copy(0, active, part.logits)), None
    k_max = int(k.max())
    p_rows = torch.nonzero(top_p < 1.0).squeeze(-1)
    c = max(k_max, TOP_P_CANDIDATES if p_rows.numel() else 1)
    gathered = comm.all_gather(_local_top(x, c), site, dim=0).view(-1, rows, c)  # [tp, rows, c]
    pool = gathered.permute(1, 0, 2).reshape(rows, -1)  # [rows, tp·c], every shard's candidates
    row_max = pool.amax(dim=-1)  # [rows]
    if k_max:
        kth = torch.topk(pool, k_max, dim=-1).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))  # [rows, 1]
        on = (k > 0).unsqueeze(-1)
        x = x.masked_fill((x < kth) & on, -math.inf)
        pool = pool.masked_fill((pool < kth) & on, -math.inf)
    if p_rows.numel():
        # Every token above ``complete`` is in the pool: a shard that sent its c best sent all
        # those above its c-th (a shard of <= c columns sent everything).
        complete = gathered[:, :, c - 1].amax(dim=0) if c < shard.shard_size else torch.full_like(row_max, -math.inf)
        x = x.index_copy(0, p_rows, _top_p(
            x.index_select(0, p_rows), pool.index_select(0, p_rows), complete.index_select(0, p_rows),
            row_max.index_select(0, p_rows), top_p.index_select(0, p_rows), site,
        ))
    if bool(min_on.any()):
        floor = row_max + torch.log(min_p.clamp(min=1e-30))  # [rows]; the maximum survives top-k and top-p
        x = x.masked_fill((x < floor.unsqueeze(-1)) & min_on.unsqueeze(-1), -math.inf)
    return shard.replace(x), row_max


def _top_p(
    x: torch.Tensor,  # [n, shard_size], top-k applied
    pool: torch.Tensor,  # [n, m] every shard's candidates, top-k applied
    complete: torch.Tensor,  # [n] every token above this value is in the pool
    row_max: torch.Tensor,  # [n]
    top_p: torch.Tensor,  # [n]
    site: str,
) -> torch.Tensor:
    """``x`` with every token below the row's top-p threshold masked, ``[n, shard_size]``."""
    total = comm.all_reduce(masses(x, row_max).sum(dim=-1), site)  # [n] int64, Z
    best = pool.sort(dim=-1, descending=True).values
    threshold, found = top_p_threshold(best, row_max, total, top_p)  # [n, 1], [n]
    pending = torch.nonzero(~(found & (threshold.squeeze(-1) > complete))).squeeze(-1)
    if pending.numel():
        threshold = threshold.index_copy(0, pending, _radix_top_p_threshold(
            x.index_select(0, pending), row_max.index_select(0, pending), total.index_select(0, pending),
            top_p.index_select(0, pending), site,
        ))
    return x.masked_fill(x < threshold, -math.inf)


def _radix_top_p_threshold(
    x: torch.Tensor,  # [n, shard_size] float32
    row_max: torch.Tensor,  # [n]
    total: torch.Tensor,  # [n] int64
    top_p: torch.Tensor,  # [n]
    site: str,
) -> torch.Tensor:
    """The largest value t with Σ_{x >= t} m(x) >= top_p·Z, ``[n, 1]``: what the sorted search
    finds. Found digit by digit on 32-bit order-preserving keys, 8 bits per round: each round
    all-reduces a ``[n, 256]`` int64 histogram of masses over the next digit of the keys that
    share the digits found so far (8 KiB per row in all, whatever the vocabulary)."""
    weight = masses(x, row_max)  # [n, shard_size] int64
    key = order_key(x) + 2**31  # [n, shard_size] in [0, 2^32)
    buckets = 1 << _RADIX_BITS
    prefix = torch.zeros_like(total)  # [n] digits found so far
    above = torch.zeros_like(total)  # [n] mass of the keys above the prefix's range
    for shift in range(32 - _RADIX_BITS, -1, -_RADIX_BITS):
        inside = (key >> (shift + _RADIX_BITS)) == prefix.unsqueeze(-1)  # [n, shard_size]
        digit = (key >> shift) & (buckets - 1)
        hist = torch.zeros(x.shape[0], buckets, dtype=torch.int64, device=x.device)
        hist = comm.all_reduce(hist.scatter_add_(1, digit, weight * inside), site)  # [n, 256]
        at_or_above = above.unsqueeze(-1) + hist.flip(-1).cumsum(-1).flip(-1)  # [n, 256], non-increasing
        d = reached(at_or_above, top_p, total).sum(dim=-1, keepdim=True) - 1  # [n, 1], the last digit that reaches
        above = (at_or_above.gather(-1, d) - hist.gather(-1, d)).squeeze(-1)
        prefix = prefix * buckets + d.squeeze(-1)
    ordered = prefix - 2**31
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(torch.int32).view(torch.float32).unsqueeze(-1)


def processed(
    shard: LogitsShard,  # raw logits, every row random (temperature > 0)
    metadata: SamplingMetadata,  # the same rows
    site: str,
) -> tuple[LogitsShard, torch.Tensor | None]:
    """``sampler.processed_logits`` on a sharded row (``logits / temperature``, then the filters),
    and the row maximum if the filters found it (else None)."""
    scaled = shard.replace(shard.logits / metadata.temperature.unsqueeze(-1))
    if metadata.no_top_k_top_p_min_p:
        return scaled, None
    return apply_top_k_top_p_min_p(scaled, metadata.top_k, metadata.top_p, metadata.min_p, site)


def sample(shard: LogitsShard, metadata: SamplingMetadata, site: str) -> torch.Tensor:
    """What ``Sampler`` draws from the gathered rows, ``[rows]`` int64: the argmax for greedy rows,
    filtered Gumbel-max (``SAMPLE`` stream) for random ones. 8·tp bytes per row, plus the
    filters' exchange when a row uses top-k, top-p or min-p."""
    values = shard.logits
    if metadata.all_random:
        proc, _ = processed(shard, metadata, site)
        values = gumbel(metadata.seeds, metadata.positions, shard.token_ids(), SAMPLE).add_(proc.logits)
    elif not metadata.all_greedy:
        rows = torch.nonzero(metadata.temperature > 0).squeeze(-1)
        sub = metadata.select(rows, random_only=True)
        proc, _ = processed(shard.select(rows), sub, site)
        values = values.index_copy(0, rows, gumbel(sub.seeds, sub.positions, shard.token_ids(), SAMPLE).add_(proc.logits))
    return argmax(shard.replace(values), site)
