"""Lossless verification without gathering the target's logits: ``RejectionSampler``'s rule and
numbers, computed from each rank's vocabulary shard.

Per batch (every row at once, not position by position), after the filters' own exchange for
rows that use top-k / top-p / min-p (``vocab_parallel.apply_top_k_top_p_min_p``):
  1. statistics, one all-gather of 2 or 3 float32 per row. Greedy rows and the bonus rows of
     random requests: the local (value, id) of the row's plain draw (argmax of the raw logits;
     ``processed + gumbel(SAMPLE)``, the bonus token). Draft rows of random requests: the
     processed logit l(d) and the draft's q(d) from the rank holding d, and the local maximum of
     the processed row (unless the filters found it). 8·tp or 12·tp bytes per row.
  2. the processed row's exact mass Z (``sample.mass``; it needs the row maximum from 1), one
     all-reduce, 8 bytes per random draft row. Every rank then takes the same accept decisions:
     greedy rows accept d iff d is the argmax; random rows iff ``u·q(d) < p(d)`` with
     ``p(d) = exp(l(d) − M)·2^38 / Z`` and ``u = uniform(seed, position, d, ACCEPT)``.
  3. at each request's first rejection in a random row, Gumbel-max (``RESIDUAL`` stream) over
     the residual ``log max(p − q, 0)``, computed on each rank's own columns: p from the row's
     (M, Z), q from the draft's local shard (greedy drafts: p without d). One all-gather of
     (value, id), 8·tp bytes per rejected row (and one more if a residual is all zero: then p).
Requests that accept every draft emit the bonus row's draw from 1.

Every decision uses the same numbers as ``RejectionSampler`` on the gathered rows (exact integer
masses, identical noise, identical tie rules), so the two agree token for token at any TP size.
Rows past a request's first rejection are processed too (their decisions are discarded), so
every target row must hold real logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpspec.distributed import comm
from tpspec.sample.gumbel import ACCEPT, RESIDUAL, SAMPLE, gumbel, uniform
from tpspec.sample.mass import masses, probs
from tpspec.sample.sampler import SamplingMetadata, select_rows
from tpspec.sample.vocab_parallel import (
    LogitsShard,
    best_of,
    gather_columns,
    gather_packed,
    local_best,
    owned_values,
    processed,
)
from tpspec.spec_decode.rejection_sampler import RejectionOutput, check_inputs, residual_log


class VocabParallelRejectionSampler:
    """Verifies draft tokens against the target's sharded rows; see the module docstring."""

    def __call__(
        self,
        target: LogitsShard,  # [num_rows, shard_size] raw target logits, k_i + 1 rows per request
        draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64, k_i per request, concatenated
        num_draft_tokens: Sequence[int],  # k_i per request (0 allowed)
        metadata: SamplingMetadata,  # one row per target row, positions = the position each row samples
        site: str,
        # [num_draft_tokens, shard_size]: this rank's columns of q; None: greedy drafts (point masses)
        draft_dists: torch.Tensor | None = None,
    ) -> RejectionOutput:
        check_inputs(target.logits.shape[0], target.vocab_size, draft_token_ids, num_draft_tokens, metadata)
        num_drafts = draft_token_ids.numel()
        if draft_dists is not None and tuple(draft_dists.shape) != (num_drafts, target.shard_size):
            raise ValueError(
                f"draft_dists must be this rank's columns of q, [{num_drafts}, {target.shard_size}], "
                f"got {tuple(draft_dists.shape)}"
            )
        if not num_draft_tokens:
            return RejectionOutput([], [])
        device = target.logits.device
        k = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)  # [num_requests]
        row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [num_requests]
        draft_start = torch.cumsum(k, 0) - k  # [num_requests]
        request = torch.repeat_interleave(torch.arange(k.numel(), device=device), k)  # [num_drafts]
        offset = torch.arange(num_drafts, device=device) - draft_start[request]  # [num_drafts], j
        draft_rows = row_start[request] + offset  # [num_drafts], the target row verifying each draft
        greedy = metadata.temperature == 0  # [num_rows]

        # Processed logits of the random rows (greedy rows keep their raw logits: never read).
        rand = torch.nonzero(~greedy).squeeze(-1)
        proc_all, known_max = target.logits, None
        if rand.numel():
            proc, known_max = processed(target.select(rand), select_rows(metadata, rand), site)
            proc_all = target.logits.index_copy(0, rand, proc.logits)

        # 1. statistics. Pair rows (greedy rows, random bonus rows): (value, id) of the local draw.
        # Random draft rows: l(d) and q(d) from the rank holding d, and the local maximum.
        bonus = row_start + k  # [num_requests]
        rand_bonus = bonus[~greedy[bonus]]
        draw = target.logits  # greedy rows: argmax of the raw logits
        if rand_bonus.numel():
            noise = gumbel(metadata.seeds[rand_bonus], metadata.positions[rand_bonus], target.token_ids(), SAMPLE)
            draw = draw.index_copy(0, rand_bonus, noise.add_(proc_all.index_select(0, rand_bonus)))
        value, gid = local_best(draw, target.vocab_start)
        rand_drafts = torch.nonzero(~greedy[draft_rows]).squeeze(-1)  # draft indices verified stochastically
        rows = draft_rows[rand_drafts]  # [m] their target rows
        proc_d = proc_all.index_select(0, rows)  # [m, shard_size]
        d = draft_token_ids[rand_drafts].unsqueeze(-1)  # [m, 1]
        per_draft = [owned_values(proc_d, target.vocab_start, d).squeeze(-1)]  # l(d)
        if draft_dists is not None:
            q_rows = draft_dists.index_select(0, rand_drafts).float()  # [m, shard_size]
            per_draft.append(owned_values(q_rows, target.vocab_start, d).squeeze(-1))
        if known_max is None:
            per_draft.append(proc_d.amax(dim=-1))
        width = max(2, len(per_draft)) if rand_drafts.numel() else 2
        pack = torch.full((value.shape[0], width), -torch.inf, device=device)  # [num_rows, width]
        pack[:, 0], pack[:, 1] = value, gid.float()
        if rand_drafts.numel():
            pack[rows, : len(per_draft)] = torch.stack(per_draft, dim=-1)
        stats = gather_packed(pack, site)  # [tp, num_rows, width]
        pair = torch.ones_like(greedy).index_fill_(0, rows, False)  # [num_rows]
        draws = best_of(stats[..., 0], torch.where(pair, stats[..., 1], 0.0))  # [num_rows], for pair rows

        # 2. accept decisions
        accepted = draft_token_ids == draws[draft_rows]  # greedy rows; random rows overwritten below
        row_max = total = None
        if rand_drafts.numel():
            top = stats.index_select(1, rows).amax(dim=0)  # [m, width]: max over ranks
            row_max = torch.full_like(value, -torch.inf)  # [num_rows]
            if known_max is None:
                row_max = row_max.index_copy(0, rows, top[:, -1])
            else:
                row_max = row_max.index_copy(0, rand, known_max)
            z = comm.all_reduce(masses(proc_d, row_max[rows]).sum(dim=-1), site)  # [m] int64
            total = torch.zeros(value.shape[0], dtype=torch.int64, device=device).index_copy(0, rows, z)  # [num_rows]
            p_d = probs(top[:, :1], row_max[rows], z).squeeze(-1)
            q_d = torch.ones_like(p_d) if draft_dists is None else top[:, 1]
            u = uniform(metadata.seeds[rows], metadata.positions[rows], d, ACCEPT).squeeze(-1)
            accepted[rand_drafts] = u * q_d < p_d  # probability min(1, p/q)

        # Accepted drafts per request: up to the first rejection.
        first_reject = torch.where(accepted, k[request], offset)
        num_accepted = k.clone().scatter_reduce_(0, request, first_reject, reduce="amin")  # [num_requests]
        final = draws[row_start + num_accepted]  # bonus draw, or a greedy row's argmax
        rejected = torch.nonzero((num_accepted < k) & ~greedy[row_start + num_accepted]).squeeze(-1)

        # 3. residual draws at the first rejection of random rows
        if rejected.numel():
            index = draft_start[rejected] + num_accepted[rejected]  # [n] into the drafts
            rows = row_start[rejected] + num_accepted[rejected]  # [n] target rows
            final[rejected] = self._residual_draws(
                target, proc_all.index_select(0, rows), rows, draft_token_ids[index], metadata,
                row_max, total, None if draft_dists is None else draft_dists.index_select(0, index), site,
            )

        drafts, starts = draft_token_ids.tolist(), draft_start.tolist()
        counts, extra = num_accepted.tolist(), final.tolist()
        outputs = [drafts[s:s + a] + [f] for s, a, f in zip(starts, counts, extra)]
        return RejectionOutput(output_token_ids=outputs, num_accepted=counts)

    @staticmethod
    def _residual_draws(
        target: LogitsShard,
        proc: torch.Tensor,  # [n, shard_size] processed logits of the rejecting rows
        rows: torch.Tensor,  # [n] their target rows
        rejected: torch.Tensor,  # [n] int64, the rejected drafts
        metadata: SamplingMetadata,  # all target rows
        row_max: torch.Tensor,  # [num_rows]
        total: torch.Tensor,  # [num_rows] int64
        draft_dists: torch.Tensor | None,  # [n, shard_size] local q of the rejected drafts, or None: point masses
        site: str,
    ) -> torch.Tensor:
        """Gumbel-max over norm(max(p − q, 0)) per row, ``[n]`` int64 (``RejectionSampler._residual_logits``)."""
        ids = target.token_ids()
        if draft_dists is None:
            residual = proc.masked_fill(ids == rejected.unsqueeze(-1), -torch.inf)
        else:
            residual = residual_log(probs(proc, row_max[rows], total[rows]), draft_dists.float())
        noise = gumbel(metadata.seeds[rows], metadata.positions[rows], ids, RESIDUAL)  # [n, shard_size]
        value, gid = local_best(noise + residual, target.vocab_start)
        g = gather_columns([value, gid.float()], site)
        out = best_of(g[..., 0], g[..., 1])
        # A residual that is zero everywhere (p <= q up to rounding) draws from p instead.
        empty = torch.nonzero(torch.isneginf(g[..., 0].amax(dim=0))).squeeze(-1)
        if empty.numel():
            value, gid = local_best(noise.index_select(0, empty).add_(proc.index_select(0, empty)), target.vocab_start)
            g = gather_columns([value, gid.float()], site)
            out[empty] = best_of(g[..., 0], g[..., 1])
        return out
