"""Lossless verification of draft tokens (Leviathan et al. 2023), batched over requests.

Request i brings k_i draft tokens and k_i + 1 target rows: row j (j < k_i) is the target's
distribution p_j at the position of draft d_j, row k_i the one after the last draft (bonus).

Greedy requests (temperature 0): accept d_j while ``d_j == argmax(row j)`` (ties to the lowest
id, as the Sampler); at the first mismatch emit that argmax, else the bonus row's argmax. This
is exactly plain greedy decoding.

Random requests, with p_j the row's processed distribution (``processed_logits``: temperature,
top-k, top-p, min-p exactly as the Sampler applies them; normalized with the exact integer masses
of ``sample.mass``, i.e. softmax up to float rounding, so that a vocab-parallel verifier gets the
same numbers) and q_j the draft's:
  1. accept d_j iff ``u_j * q_j(d_j) < p_j(d_j)``, i.e. with probability min(1, p/q), where
     ``u_j = uniform(seed, position_j, token id = d_j, ACCEPT)``;
  2. at the first rejection emit ``argmax(log max(p_j - q_j, 0) + gumbel(seed, position_j, id,
     RESIDUAL))``, a draw from norm(max(p - q, 0)), and stop. Greedy drafts (no
     ``draft_probs``) have q = a point mass on d_j: the residual is p_j with d_j removed, drawn
     as ``argmax(log p_j with d_j masked + gumbel(RESIDUAL))``, the same numbers as a one-hot q;
  3. if all k_i are accepted, emit ``argmax(processed_bonus + gumbel(seed, position, id,
     SAMPLE))``: what the plain Sampler draws at that position, so k_i = 0 is the Sampler.

Verification runs position by position, batched over the requests still accepting, so rows past
a request's first rejection are never read (their logits need not even be valid).

Every random number is keyed by (request seed, the row's position, global token id, stream), so
the decisions are the same on every rank and at every TP size. The three streams never reuse a
number: one position is decided once (acceptance, then residual or bonus), and the draft's own
noise comes from the DRAFT stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpspec.layers.argmax import argmax_rows
from tpspec.sample.gumbel import ACCEPT, RESIDUAL, SAMPLE, gumbel, uniform
from tpspec.sample.mass import masses, probs
from tpspec.sample.sampler import SamplingMetadata, processed_logits


@dataclass(frozen=True)
class RejectionOutput:
    output_token_ids: list[list[int]]  # per request: accepted drafts + one recovered/bonus token
    num_accepted: list[int]  # per request: accepted drafts, 0..k_i


def check_inputs(
    target_rows: int,  # rows of the target's logits
    vocab_size: int,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    metadata: SamplingMetadata,
) -> None:
    """The checks every verifier makes (``ValueError`` naming the argument)."""
    for k in num_draft_tokens:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_draft_tokens must hold integers >= 0, got {list(num_draft_tokens)}")
    num_drafts = sum(num_draft_tokens)
    num_rows = num_drafts + len(num_draft_tokens)
    if target_rows != num_rows:
        raise ValueError(
            f"target_logits must have num_rows = sum(k_i + 1) = {num_rows} rows, got {target_rows}"
        )
    if draft_token_ids.dim() != 1 or draft_token_ids.numel() != num_drafts or draft_token_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids must be a [{num_drafts}] int64 tensor (sum of num_draft_tokens), got shape "
            f"{tuple(draft_token_ids.shape)} dtype {draft_token_ids.dtype}"
        )
    if num_drafts and (int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= vocab_size):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab_size}), got {draft_token_ids.tolist()}")
    if metadata.temperature.shape[0] != num_rows:
        raise ValueError(
            f"metadata must have one row per target row ({num_rows}), got {metadata.temperature.shape[0]}"
        )


def _check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    metadata: SamplingMetadata,
    draft_probs: torch.Tensor | None,
    draft_dists: torch.Tensor | None,
) -> None:
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [num_rows, vocab_size], got {tuple(target_logits.shape)}")
    check_inputs(target_logits.shape[0], target_logits.shape[1], draft_token_ids, num_draft_tokens, metadata)
    num_drafts, vocab = draft_token_ids.numel(), target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts,):
        raise ValueError(f"draft_probs must be [{num_drafts}], got {tuple(draft_probs.shape)}")
    if draft_dists is not None and tuple(draft_dists.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_dists must be [{num_drafts}, {vocab}], got {tuple(draft_dists.shape)}")
    if draft_probs is not None and draft_dists is None:
        raise ValueError(
            "draft_dists is required with draft_probs: a rejected probabilistic draft is resampled "
            "from max(p - q, 0), which needs the full draft distribution q"
        )


def residual_log(
    p: torch.Tensor,  # [n, m] float32, target probabilities
    q: torch.Tensor,  # [n, m] float32, draft probabilities
) -> torch.Tensor:
    """log max(p − q, 0), ``[n, m]``: logits of the residual distribution norm(max(p − q, 0))."""
    return (p - q).clamp_(min=0).log_()


def point_residual_log(
    p: torch.Tensor,  # [n, m] float32, target probabilities
    is_draft: torch.Tensor,  # [n, m] bool, the rejected draft's column (none on a shard without it)
) -> torch.Tensor:
    """``residual_log(p, q)`` for q a point mass on the rejected draft, bit for bit (so greedy
    drafts verified as one-hot q rows beside probabilistic ones draw the same tokens), without
    building q: log p with the draft removed."""
    return p.log().masked_fill_(is_draft, -torch.inf)


class RejectionSampler:
    """Verifies draft tokens against the target's rows; see the module docstring for the rule.

    Works position by position (j = 0, 1, ...), each step batched over the requests whose drafts
    so far were all accepted, so a row after a request's first rejection is never read: the
    full-vocabulary work is about ``num_requests * (mean accepted + 2)`` rows, not all rows.
    """

    def __call__(
        self,
        target_logits: torch.Tensor,  # [num_rows, vocab_size] float, k_i + 1 rows per request
        draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64, k_i per request, concatenated
        num_draft_tokens: Sequence[int],  # k_i per request (0 allowed)
        metadata: SamplingMetadata,  # one row per target row, positions = the position each row samples
        draft_probs: torch.Tensor | None = None,  # [num_draft_tokens] float32, q(d); None: greedy drafts
        draft_dists: torch.Tensor | None = None,  # [num_draft_tokens, vocab_size] float32, full q
    ) -> RejectionOutput:
        _check_inputs(target_logits, draft_token_ids, num_draft_tokens, metadata, draft_probs, draft_dists)
        if not num_draft_tokens:
            return RejectionOutput([], [])
        if metadata.all_greedy and draft_probs is None and draft_dists is None:
            return self._greedy(target_logits, draft_token_ids, num_draft_tokens)
        device = target_logits.device
        k = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)  # [num_requests]
        row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [num_requests]
        draft_start = torch.cumsum(k, 0) - k  # [num_requests]
        num_accepted = torch.zeros_like(k)  # [num_requests]
        final = torch.zeros_like(k)  # [num_requests], the recovered or bonus token
        probabilistic = draft_probs is not None or draft_dists is not None

        active = torch.nonzero(k > 0).squeeze(-1)  # requests with draft j still to verify
        for j in range(max(num_draft_tokens)):
            if active.numel() == 0:
                break
            rows = row_start[active] + j
            index = draft_start[active] + j  # into the drafts
            drafts = draft_token_ids[index]
            accepted, recovered = self._verify_position(
                target_logits, rows, drafts, metadata,
                None if not probabilistic else (
                    draft_probs[index] if draft_probs is not None else draft_dists[index, drafts]
                ),
                None if draft_dists is None else draft_dists.index_select(0, index),
            )
            num_accepted[active[accepted]] += 1
            final[active[~accepted]] = recovered
            active = active[accepted & (k[active] > j + 1)]

        bonus = torch.nonzero(num_accepted == k).squeeze(-1)
        if bonus.numel():
            final[bonus] = self._sample_rows(target_logits, row_start[bonus] + k[bonus], metadata)

        drafts, starts = draft_token_ids.tolist(), draft_start.tolist()
        counts, extra = num_accepted.tolist(), final.tolist()
        outputs = [drafts[s:s + a] + [f] for s, a, f in zip(starts, counts, extra)]
        return RejectionOutput(output_token_ids=outputs, num_accepted=counts)

    @staticmethod
    def _greedy(
        target_logits: torch.Tensor,  # [num_rows, vocab_size] float, k_i + 1 rows per request
        draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
        num_draft_tokens: Sequence[int],
    ) -> RejectionOutput:
        """Every row greedy, greedy drafts: one argmax over all rows (what the position loop takes
        row by row, the same op, lowest id on ties), then each request keeps its drafts up to the
        first that differs from its row's argmax and that argmax after them."""
        top = argmax_rows(target_logits.float()).tolist()  # [num_rows]
        drafts = draft_token_ids.tolist()
        outputs, counts = [], []
        row = d = 0
        for k in num_draft_tokens:
            a = 0
            while a < k and drafts[d + a] == top[row + a]:
                a += 1
            outputs.append(drafts[d : d + a] + [top[row + a]])
            counts.append(a)
            row, d = row + k + 1, d + k
        return RejectionOutput(output_token_ids=outputs, num_accepted=counts)

    def _verify_position(
        self,
        target_logits: torch.Tensor,  # [num_rows, vocab_size]
        rows: torch.Tensor,  # [m] int64, target rows verifying one draft each
        drafts: torch.Tensor,  # [m] int64, the drafts
        metadata: SamplingMetadata,  # all target rows
        q_d: torch.Tensor | None,  # [m] q(draft), or None: greedy drafts (q = point mass)
        q: torch.Tensor | None,  # [m, vocab_size] full q, or None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether each draft is accepted ``[m]`` bool, and the tokens of the rejected ones ``[rejected]``."""
        accepted = torch.empty_like(drafts, dtype=torch.bool)
        recovered = torch.empty_like(drafts)  # filled on rejected entries
        greedy = metadata.temperature.index_select(0, rows) == 0  # [m]
        g, r = torch.nonzero(greedy).squeeze(-1), torch.nonzero(~greedy).squeeze(-1)
        if g.numel():
            top = argmax_rows(target_logits.index_select(0, rows[g]).float())  # lowest id on ties
            accepted[g] = drafts[g] == top
            recovered[g] = top
        if r.numel():
            r_rows, d = rows[r], drafts[r]
            proc = processed_logits(target_logits.index_select(0, r_rows).float(), metadata.select(r_rows, random_only=True))
            row_max = proc.amax(dim=-1)  # [n]
            total = masses(proc, row_max).sum(dim=-1)  # [n] int64
            p_d = probs(proc.gather(-1, d.unsqueeze(-1)), row_max, total).squeeze(-1)  # [n]
            q_r = torch.ones_like(p_d) if q_d is None else q_d[r].float()
            u = uniform(metadata.seeds[r_rows], metadata.positions[r_rows], d.unsqueeze(-1), ACCEPT).squeeze(-1)
            ok = u * q_r < p_d  # probability min(1, p/q)
            accepted[r] = ok
            rej = torch.nonzero(~ok).squeeze(-1)
            if rej.numel():
                residual = self._residual_logits(
                    proc[rej], row_max[rej], total[rej], d[rej], None if q is None else q.index_select(0, r[rej]),
                )
                token_ids = torch.arange(proc.shape[-1], device=proc.device, dtype=torch.int64)
                rej_rows = r_rows[rej]
                noise = gumbel(metadata.seeds[rej_rows], metadata.positions[rej_rows], token_ids, RESIDUAL)
                recovered[r[rej]] = argmax_rows(noise.add_(residual))
        return accepted, recovered[~accepted]

    @staticmethod
    def _sample_rows(
        target_logits: torch.Tensor,  # [num_rows, vocab_size]
        rows: torch.Tensor,  # [m] int64
        metadata: SamplingMetadata,  # all target rows
    ) -> torch.Tensor:
        """What the plain Sampler draws at these rows (argmax or SAMPLE-stream Gumbel-max), ``[m]``."""
        logits = target_logits.index_select(0, rows).float()
        out = argmax_rows(logits)  # lowest id on ties
        r = torch.nonzero(metadata.temperature.index_select(0, rows) > 0).squeeze(-1)
        if r.numel():
            r_rows = rows[r]
            proc = processed_logits(logits.index_select(0, r), metadata.select(r_rows, random_only=True))
            token_ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
            noise = gumbel(metadata.seeds[r_rows], metadata.positions[r_rows], token_ids, SAMPLE)
            out[r] = argmax_rows(noise.add_(proc))
        return out

    @staticmethod
    def _residual_logits(
        proc: torch.Tensor,  # [n, vocab] float32, processed target logits of the rejecting rows
        row_max: torch.Tensor,  # [n] float32, their maximum
        total: torch.Tensor,  # [n] int64, their mass Z (``sample.mass``)
        rejected: torch.Tensor,  # [n] int64, the rejected draft tokens
        draft_dists: torch.Tensor | None,  # [n, vocab] float32 q, or None: q = point mass on ``rejected``
    ) -> torch.Tensor:
        """Logits (up to a per-row constant) of norm(max(p - q, 0)), ``[n, vocab]``.

        A row whose residual is all zero (p <= q everywhere, which only rounding can make
        rejectable) falls back to p.
        """
        p = probs(proc, row_max, total)  # [n, vocab]
        if draft_dists is None:
            is_draft = torch.arange(proc.shape[-1], device=proc.device) == rejected.unsqueeze(-1)  # [n, vocab]
            residual = point_residual_log(p, is_draft)
        else:
            residual = residual_log(p, draft_dists.float())
        empty = torch.isneginf(residual.amax(dim=-1))  # [n]
        if bool(empty.any()):
            residual = torch.where(empty.unsqueeze(-1), proc, residual)
        return residual
