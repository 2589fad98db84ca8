"""Lossless verification without gathering the target's logits: ``RejectionSampler``'s rule and
numbers, computed from each rank's vocabulary shard.

Like ``RejectionSampler`` it works position by position (j = 0, 1, ...), each round batched over
the requests whose drafts so far were all accepted, so rows after a request's first rejection are
never read. A round, for the draft rows it verifies:
  1. statistics, one all-gather of 2 or 3 float32 per row (after the filters' own exchange for
     random rows that use top-k / top-p / min-p, ``vocab_parallel.apply_top_k_top_p_min_p``).
     Greedy rows: the local (value, id) of the argmax of the raw logits. Random rows: the
     processed logit l(d) and the draft's q(d) from the rank holding d, and the local maximum of
     the processed row (unless the filters found it). 8·tp or 12·tp bytes per row.
  2. the processed row's exact mass Z (``sample.mass``; it needs the row maximum from 1), one
     all-reduce, 8 bytes per random row. Every rank then takes the same accept decisions: greedy
     rows accept d iff d is the argmax (else the argmax is the recovered token); random rows iff
     ``u·q(d) < p(d)`` with ``p(d) = exp(l(d) − M)·2^38 / Z`` and ``u = uniform(seed, position,
     d, ACCEPT)``.
Then one last all-gather of (value, id), 8·tp bytes per request still to settle: at a random
request's first rejection, Gumbel-max (``RESIDUAL`` stream) over the residual
``log max(p − q, 0)``, computed on each rank's own columns from the row's (M, Z) and the draft's
local q (greedy drafts: p without d); for a request that accepted every draft, the bonus row's
plain draw (argmax, or ``processed + gumbel(SAMPLE)``). A residual that is zero everywhere takes
one more all-gather (then p).

Every decision uses the same numbers as ``RejectionSampler`` on the gathered rows (exact integer
masses, identical noise, identical tie rules), so the two agree token for token at any TP size.
The rounds depend only on gathered numbers, so every rank runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

import torch

from tpspec.distributed import comm
from tpspec.sample.gumbel import ACCEPT, RESIDUAL, SAMPLE, gumbel, uniform
from tpspec.sample.mass import masses, probs
from tpspec.sample.sampler import SamplingMetadata
from tpspec.sample.vocab_parallel import (
    LogitsShard,
    best_of,
    gather_columns,
    gather_packed,
    local_best,
    owned_values,
    processed,
)
from tpspec.spec_decode.rejection_sampler import RejectionOutput, check_inputs, point_residual_log, residual_log


@dataclass
class _Rejections:
    """Random rows rejected in one round, kept for their residual draw."""

    requests: torch.Tensor  # [n] int64, request indices
    rows: torch.Tensor  # [n] int64, their target rows
    drafts: torch.Tensor  # [n] int64, indices of the rejected drafts
    proc: torch.Tensor  # [n, shard_size] processed logits
    row_max: torch.Tensor  # [n] float32, M
    total: torch.Tensor  # [n] int64, Z

    @staticmethod
    def cat(parts: list["_Rejections"]) -> "_Rejections":
        return _Rejections(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(_Rejections)))


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
        num_accepted = torch.zeros_like(k)  # [num_requests]
        final = torch.zeros_like(k)  # [num_requests], the recovered or bonus token
        settled = torch.zeros_like(k, dtype=torch.bool)  # [num_requests], final already known
        rejections: list[_Rejections] = []

        active = torch.nonzero(k > 0).squeeze(-1)  # requests with draft j still to verify
        for j in range(max(num_draft_tokens)):
            if active.numel() == 0:
                break
            rows, index = row_start[active] + j, draft_start[active] + j
            accepted, top, rejected = self._verify_position(
                target, active, rows, index, draft_token_ids, metadata, draft_dists, site)
            num_accepted[active[accepted]] += 1
            greedy_rejected = torch.nonzero(~accepted & (metadata.temperature[rows] == 0)).squeeze(-1)
            final[active[greedy_rejected]] = top[greedy_rejected]  # the greedy row's argmax
            settled[active[greedy_rejected]] = True
            if rejected is not None:
                rejections.append(rejected)
            active = active[accepted & (k[active] > j + 1)]

        pending = torch.nonzero(~settled).squeeze(-1)  # every random request, greedy ones with a bonus
        if pending.numel():
            final[pending] = self._final_draws(target, pending, row_start + num_accepted, draft_token_ids,
                                               metadata, draft_dists, rejections, site)

        drafts, starts = draft_token_ids.tolist(), draft_start.tolist()
        counts, extra = num_accepted.tolist(), final.tolist()
        outputs = [drafts[s:s + a] + [f] for s, a, f in zip(starts, counts, extra)]
        return RejectionOutput(output_token_ids=outputs, num_accepted=counts)

    @staticmethod
    def _verify_position(
        target: LogitsShard,
        requests: torch.Tensor,  # [m] int64, the requests verified in this round
        rows: torch.Tensor,  # [m] int64, their target rows, one draft each
        index: torch.Tensor,  # [m] int64, the drafts they verify
        draft_token_ids: torch.Tensor,  # [num_drafts] int64
        metadata: SamplingMetadata,  # all target rows
        draft_dists: torch.Tensor | None,  # [num_drafts, shard_size] local q, or None
        site: str,
    ) -> tuple[torch.Tensor, torch.Tensor, _Rejections | None]:
        """Whether each draft is accepted ``[m]`` bool; each greedy row's argmax ``[m]`` int64
        (meaningless on random rows); the rejected random rows, if any."""
        device = rows.device
        drafts = draft_token_ids[index]  # [m]
        greedy = metadata.temperature[rows] == 0  # [m]
        g, r = torch.nonzero(greedy).squeeze(-1), torch.nonzero(~greedy).squeeze(-1)
        pack = torch.full((rows.numel(), 2), -torch.inf, device=device)  # [m, width]
        if g.numel():
            value, gid = local_best(target.logits.index_select(0, rows[g]), target.vocab_start)
            pack[g] = torch.stack([value, gid.float()], dim=-1)
        proc = known_max = None
        if r.numel():
            r_rows, d = rows[r], drafts[r].unsqueeze(-1)  # [n], [n, 1]
            proc, known_max = processed(target.select(r_rows), metadata.select(r_rows, random_only=True), site)
            per_row = [owned_values(proc.logits, target.vocab_start, d).squeeze(-1)]  # l(d)
            if draft_dists is not None:
                local = d.squeeze(-1) - target.vocab_start
                own = (local >= 0) & (local < target.shard_size)
                q_d = draft_dists[index[r], local.clamp(0, target.shard_size - 1)].float()
                per_row.append(q_d.masked_fill(~own, -torch.inf))  # q(d)
            if known_max is None:
                per_row.append(proc.logits.amax(dim=-1))
            random_pack = torch.stack(per_row, dim=-1)  # [n, 1..3]
            if random_pack.shape[-1] > 2:
                pack = torch.cat([pack, torch.full_like(pack[:, :1], -torch.inf)], dim=-1)
            pack[r, : random_pack.shape[-1]] = random_pack
        stats = gather_packed(pack, site)  # [tp, m, width]

        accepted = torch.empty_like(greedy)
        top = torch.zeros_like(drafts)
        if g.numel():
            top[g] = best_of(stats[:, g, 0], stats[:, g, 1])
            accepted[g] = drafts[g] == top[g]
        if not r.numel():
            return accepted, top, None
        best = stats.index_select(1, r).amax(dim=0)  # [n, width]: max over ranks
        row_max = known_max if known_max is not None else best[:, -1]
        total = comm.all_reduce(masses(proc.logits, row_max).sum(dim=-1), site)  # [n] int64
        p_d = probs(best[:, :1], row_max, total).squeeze(-1)
        q_d = torch.ones_like(p_d) if draft_dists is None else best[:, 1]
        u = uniform(metadata.seeds[r_rows], metadata.positions[r_rows], d, ACCEPT).squeeze(-1)
        ok = u * q_d < p_d  # probability min(1, p/q)
        accepted[r] = ok
        rej = torch.nonzero(~ok).squeeze(-1)
        if not rej.numel():
            return accepted, top, None
        return accepted, top, _Rejections(
            requests=requests[r[rej]], rows=r_rows[rej], drafts=index[r[rej]], proc=proc.logits.index_select(0, rej),
            row_max=row_max[rej], total=total[rej],
        )

    @staticmethod
    def _final_draws(
        target: LogitsShard,
        pending: torch.Tensor,  # [n] int64, requests whose final token is still to draw
        last_row: torch.Tensor,  # [num_requests] int64, each request's row after its accepted drafts
        draft_token_ids: torch.Tensor,  # [num_drafts] int64
        metadata: SamplingMetadata,  # all target rows
        draft_dists: torch.Tensor | None,  # [num_drafts, shard_size] local q, or None
        rejections: list[_Rejections],
        site: str,
    ) -> torch.Tensor:
        """The final token of each pending request, ``[n]`` int64, in one all-gather of (value,
        id): the residual draw at a random rejection, else the bonus row's plain draw."""
        n = pending.numel()
        value = torch.empty(n, device=pending.device)  # [n] this shard's best
        gid = torch.empty(n, dtype=torch.int64, device=pending.device)  # [n] its global id
        slot = torch.full_like(last_row, -1)  # [num_requests], position in ``pending``
        slot[pending] = torch.arange(n, device=pending.device)
        has_residual = torch.zeros_like(last_row, dtype=torch.bool)  # [num_requests]
        ids = target.token_ids()

        rej = _Rejections.cat(rejections) if rejections else None
        if rej is not None:
            p = probs(rej.proc, rej.row_max, rej.total)  # [n_rej, shard_size]
            if draft_dists is None:  # greedy drafts: p without d
                residual = point_residual_log(p, ids == draft_token_ids[rej.drafts].unsqueeze(-1))
            else:
                residual = residual_log(p, draft_dists.index_select(0, rej.drafts).float())
            noise = gumbel(metadata.seeds[rej.rows], metadata.positions[rej.rows], ids, RESIDUAL)  # [n_rej, shard_size]
            value[slot[rej.requests]], gid[slot[rej.requests]] = local_best(noise + residual, target.vocab_start)
            has_residual[rej.requests] = True

        bonus = pending[~has_residual[pending]]
        if bonus.numel():
            rows = last_row[bonus]
            draw = target.logits.index_select(0, rows)  # greedy rows: argmax of the raw logits
            r = torch.nonzero(metadata.temperature[rows] > 0).squeeze(-1)
            if r.numel():
                sub = metadata.select(rows[r], random_only=True)
                proc, _ = processed(target.replace(draw.index_select(0, r)), sub, site)
                draw[r] = gumbel(sub.seeds, sub.positions, ids, SAMPLE).add_(proc.logits)
            value[slot[bonus]], gid[slot[bonus]] = local_best(draw, target.vocab_start)

        g = gather_columns([value, gid.float()], site)  # [tp, n, 2]
        out = best_of(g[..., 0], g[..., 1])
        if rej is None:
            return out
        # A residual that is zero everywhere (p <= q up to rounding) draws from p instead.
        residual_slots = slot[rej.requests]
        empty = torch.nonzero(torch.isneginf(g[:, residual_slots, 0].amax(dim=0))).squeeze(-1)
        if empty.numel():
            v, i = local_best(noise.index_select(0, empty).add_(rej.proc.index_select(0, empty)), target.vocab_start)
            e = gather_columns([v, i.float()], site)
            out[residual_slots[empty]] = best_of(e[..., 0], e[..., 1])
        return out
