"""Probabilistic drafting: draw a draft token per row and keep the distribution q it came from,
which lossless verification needs (acceptance min(1, p/q), residual max(p − q, 0)).

q is the request's own processed draft distribution: ``logits / max(temperature, 0.01)``, then
top-k, top-p, min-p as the Sampler applies them, normalized with the exact masses of
``sample.mass``; the draft token is its Gumbel-max with the ``DRAFT`` noise stream. Greedy
requests (temperature 0) draft the argmax with q = a point mass on it.

``sample_draft_full`` works on gathered logits and returns the full q ``[rows, vocab_size]``;
``sample_draft_shard`` works on this rank's columns only (``use_local_argmax_reduction``): one
all-gather of (value, id, local max), 12·tp bytes per row (8·tp when the filters already found
the maximum), plus an all-reduce of the exact mass Z (8 bytes per row), and it returns this
rank's columns of q ``[rows, shard_size]``: the vocab-parallel verifier reads q(d) from the rank
holding d and the residual shard-locally, so q is never gathered. The two give the same tokens,
and q bit for bit (the shards of one are the columns of the other).
"""

from __future__ import annotations

import torch

from tpspec.distributed import comm
from tpspec.sample import vocab_parallel
from tpspec.sample.gumbel import DRAFT, gumbel
from tpspec.sample.mass import masses, probs
from tpspec.sample.sampler import SamplingMetadata, apply_top_k_top_p_min_p
from tpspec.sample.vocab_parallel import LogitsShard


def _temperature(sampling: SamplingMetadata) -> torch.Tensor:
    """Each row's temperature, greedy rows clamped (their draw is replaced by the argmax): ``[rows, 1]``."""
    return sampling.temperature.clamp(min=1e-2).unsqueeze(-1)


def sample_draft_full(
    logits: torch.Tensor,  # [rows, vocab_size] float32, gathered
    sampling: SamplingMetadata,  # one row per draft row (positions = each draft token's)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens ``[rows]`` int64 and their distributions q ``[rows, vocab_size]`` float32."""
    scaled = apply_top_k_top_p_min_p(logits / _temperature(sampling), sampling.top_k, sampling.top_p, sampling.min_p)
    row_max = scaled.amax(dim=-1)  # [rows]
    q = probs(scaled, row_max, masses(scaled, row_max).sum(dim=-1))
    token_ids = torch.arange(logits.shape[-1], device=logits.device)
    sampled = (scaled + gumbel(sampling.seeds, sampling.positions, token_ids, DRAFT)).argmax(dim=-1)
    greedy = sampling.temperature == 0
    if greedy.any():
        top = logits.argmax(dim=-1)
        sampled = torch.where(greedy, top, sampled)
        q = torch.where(greedy.unsqueeze(-1), (token_ids == top.unsqueeze(-1)).float(), q)
    return sampled, q


def sample_draft_shard(
    shard: LogitsShard,  # [rows, shard_size] this rank's draft logits
    sampling: SamplingMetadata,  # one row per draft row
    site: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens ``[rows]`` int64 (same on every rank) and this rank's columns of their q
    ``[rows, shard_size]`` float32: ``sample_draft_full`` without gathering the vocabulary."""
    scaled, row_max = vocab_parallel.apply_top_k_top_p_min_p(
        shard.replace(shard.logits / _temperature(sampling)), sampling.top_k, sampling.top_p, sampling.min_p, site
    )
    token_ids = shard.token_ids()
    greedy = (sampling.temperature == 0).unsqueeze(-1)  # [rows, 1]
    noisy = gumbel(sampling.seeds, sampling.positions, token_ids, DRAFT).add_(scaled.logits)
    value, gid = vocab_parallel.local_best(torch.where(greedy, shard.logits, noisy), shard.vocab_start)
    columns = [value, gid.float()] + ([scaled.logits.amax(dim=-1)] if row_max is None else [])
    g = vocab_parallel.gather_columns(columns, site)  # [tp, rows, 2 or 3]
    sampled = vocab_parallel.best_of(g[..., 0], g[..., 1])
    if row_max is None:
        row_max = g[..., 2].amax(dim=0)
    total = comm.all_reduce(masses(scaled.logits, row_max).sum(dim=-1), site)  # [rows] int64
    q = probs(scaled.logits, row_max, total)  # [rows, shard_size]
    q = torch.where(greedy, (token_ids == sampled.unsqueeze(-1)).float(), q)
    return sampled, q
