"""Lossless verification of draft tokens (Leviathan et al. 2023), batched over requests.

Request i brings k_i draft tokens and k_i + 1 target rows: row j (j < k_i) is the target's
distribution p_j at the position of draft d_j, row k_i the one after the last draft (bonus).

Greedy requests (temperature 0): accept d_j while ``d_j == argmax(row j)`` (ties to the lowest
id, as the Sampler); at the first mismatch emit that argmax, else the bonus row's argmax. This
is exactly plain greedy decoding.

Random requests, with p_j the row's processed distribution (``softmax(processed_logits(...))``:
temperature, top-k, top-p, min-p exactly as the Sampler applies them) and q_j the draft's:
  1. accept d_j iff ``u_j * q_j(d_j) < p_j(d_j)``, i.e. with probability min(1, p/q), where
     ``u_j = uniform(seed, position_j, token id = d_j, ACCEPT)``;
  2. at the first rejection emit ``argmax(log max(p_j - q_j, 0) + gumbel(seed, position_j, id,
     RESIDUAL))``, a draw from norm(max(p - q, 0)), and stop. Greedy drafts (no
     ``draft_probs``) have q = a point mass on d_j: the residual is p_j with d_j removed, drawn
     as ``argmax(processed_j with d_j masked + gumbel(RESIDUAL))``;
  3. if all k_i are accepted, emit ``argmax(processed_bonus + gumbel(seed, position, id,
     SAMPLE))``: what the plain Sampler draws at that position, so k_i = 0 is the Sampler.

Every random number is keyed by (request seed, the row's position, global token id, stream), so
the decisions are the same on every rank and at every TP size. The three streams never reuse a
number: one position is decided once (acceptance, then residual or bonus), and the draft's own
noise comes from the DRAFT stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpspec.sample.gumbel import ACCEPT, RESIDUAL, SAMPLE, gumbel, uniform
from tpspec.sample.sampler import SamplingMetadata, processed_logits, select_rows


@dataclass(frozen=True)
class RejectionOutput:
    output_token_ids: list[list[int]]  # per request: accepted drafts + one recovered/bonus token
    num_accepted: list[int]  # per request: accepted drafts, 0..k_i


@dataclass(frozen=True)
class _Layout:
    """Where each request's rows and drafts sit in the concatenated tensors."""

    num_drafts: torch.Tensor  # [num_requests] int64, k_i
    row_start: torch.Tensor  # [num_requests] int64, first target row of request i
    draft_start: torch.Tensor  # [num_requests] int64, first draft token of request i
    draft_request: torch.Tensor  # [num_draft_tokens] int64, request of each draft
    draft_offset: torch.Tensor  # [num_draft_tokens] int64, j of each draft within its request
    draft_row: torch.Tensor  # [num_draft_tokens] int64, target row that verifies each draft

    @classmethod
    def build(cls, num_draft_tokens: Sequence[int], device: torch.device) -> "_Layout":
        k = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)
        row_start = torch.cumsum(k + 1, 0) - (k + 1)
        draft_start = torch.cumsum(k, 0) - k
        draft_request = torch.repeat_interleave(torch.arange(k.numel(), device=device), k)
        draft_offset = torch.arange(draft_request.numel(), device=device) - draft_start[draft_request]
        return cls(k, row_start, draft_start, draft_request, draft_offset, row_start[draft_request] + draft_offset)

    def leading_accepted(
        self,
        accepted: torch.Tensor,  # [num_draft_tokens] bool
    ) -> torch.Tensor:
        """Per request, the number of drafts accepted before the first rejection ``[num_requests]``."""
        n = self.num_drafts.numel()
        k_max = int(self.num_drafts.max()) if n else 0
        # One extra always-rejected column (and padding) so every row has a first rejection.
        rejected = torch.ones(n, k_max + 1, dtype=torch.uint8, device=accepted.device)
        rejected[self.draft_request, self.draft_offset] = (~accepted).to(torch.uint8)
        return rejected.argmax(dim=-1)  # first maximum: the first rejection


def _check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    metadata: SamplingMetadata,
    draft_probs: torch.Tensor | None,
    draft_dists: torch.Tensor | None,
) -> None:
    for k in num_draft_tokens:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_draft_tokens must hold integers >= 0, got {list(num_draft_tokens)}")
    num_drafts = sum(num_draft_tokens)
    num_rows = num_drafts + len(num_draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
        raise ValueError(
            f"target_logits must be [num_rows, vocab_size] with num_rows = sum(k_i + 1) = {num_rows}, "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    if draft_token_ids.dim() != 1 or draft_token_ids.numel() != num_drafts or draft_token_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids must be a [{num_drafts}] int64 tensor (sum of num_draft_tokens), got shape "
            f"{tuple(draft_token_ids.shape)} dtype {draft_token_ids.dtype}"
        )
    if num_drafts and (int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= vocab):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab}), got {draft_token_ids.tolist()}")
    if metadata.temperature.shape[0] != num_rows:
        raise ValueError(
            f"metadata must have one row per target row ({num_rows}), got {metadata.temperature.shape[0]}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts,):
        raise ValueError(f"draft_probs must be [{num_drafts}], got {tuple(draft_probs.shape)}")
    if draft_dists is not None and tuple(draft_dists.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_dists must be [{num_drafts}, {vocab}], got {tuple(draft_dists.shape)}")
    if draft_probs is not None and draft_dists is None:
        raise ValueError(
            "draft_dists is required with draft_probs: a rejected probabilistic draft is resampled "
            "from max(p - q, 0), which needs the full draft distribution q"
        )


class RejectionSampler:
    """Verifies draft tokens against the target's rows; see the module docstring for the rule."""

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
        logits = target_logits.float()
        device = logits.device
        num_rows, vocab = logits.shape
        layout = _Layout.build(num_draft_tokens, device)
        greedy = metadata.temperature == 0  # [num_rows]
        any_greedy, any_random = not metadata.all_random, not metadata.all_greedy
        if not metadata.all_greedy and not metadata.all_random:
            any_greedy, any_random = bool(greedy.any()), bool((~greedy).any())

        # Greedy rows: the target's argmax.
        top = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [num_rows], valid on greedy rows
        if any_greedy:
            if not any_random:
                top = logits.argmax(dim=-1)  # first maximum: lowest id on ties
            else:
                g_rows = torch.nonzero(greedy).squeeze(-1)
                top[g_rows] = logits.index_select(0, g_rows).argmax(dim=-1)

        # Random rows: the processed logits and their logsumexp, in a compact [num_random, vocab].
        slot = torch.full((num_rows,), -1, dtype=torch.int64, device=device)  # row -> index in proc
        proc = lse = None
        if any_random:
            if not any_greedy:
                r_rows = torch.arange(num_rows, device=device)
                proc = processed_logits(logits, metadata)  # [num_rows, vocab]
            else:
                r_rows = torch.nonzero(~greedy).squeeze(-1)
                proc = processed_logits(logits.index_select(0, r_rows), select_rows(metadata, r_rows))
            slot[r_rows] = torch.arange(r_rows.numel(), device=device)
            lse = torch.logsumexp(proc, dim=-1)  # [num_random]

        # Acceptance of every draft (only those before a request's first rejection count).
        draft_greedy = greedy[layout.draft_row]  # [num_draft_tokens]
        accepted = draft_token_ids == top[layout.draft_row]  # right on greedy rows
        if any_random:
            rd = torch.nonzero(~draft_greedy).squeeze(-1)  # random drafts
            if rd.numel():
                rows = layout.draft_row[rd]
                d = draft_token_ids[rd]
                s = slot[rows]
                p_d = (proc[s, d] - lse[s]).exp()
                if draft_probs is not None:
                    q_d = draft_probs[rd].float()
                elif draft_dists is not None:
                    q_d = draft_dists[rd, d].float()
                else:
                    q_d = torch.ones_like(p_d)
                u = uniform(metadata.seeds[rows], metadata.positions[rows], d.unsqueeze(-1), ACCEPT).squeeze(-1)
                accepted[rd] = u * q_d < p_d
        num_accepted = layout.leading_accepted(accepted)  # [num_requests]

        # The one extra token per request, from the row right after the accepted drafts.
        final_row = layout.row_start + num_accepted  # [num_requests]
        final = top[final_row]  # right for greedy requests
        if any_random:
            token_ids = torch.arange(vocab, device=device, dtype=torch.int64)
            random_final = ~greedy[final_row]
            is_bonus = num_accepted == layout.num_drafts

            bonus = torch.nonzero(random_final & is_bonus).squeeze(-1)
            if bonus.numel():
                rows = final_row[bonus]
                noise = gumbel(metadata.seeds[rows], metadata.positions[rows], token_ids, SAMPLE)
                final[bonus] = noise.add_(proc[slot[rows]]).argmax(dim=-1)

            recover = torch.nonzero(random_final & ~is_bonus).squeeze(-1)
            if recover.numel():
                rows = final_row[recover]
                draft_index = layout.draft_start[recover] + num_accepted[recover]
                residual = self._residual_logits(
                    proc[slot[rows]], lse[slot[rows]], draft_token_ids[draft_index],
                    None if draft_probs is None and draft_dists is None else draft_dists[draft_index],
                )
                noise = gumbel(metadata.seeds[rows], metadata.positions[rows], token_ids, RESIDUAL)
                final[recover] = noise.add_(residual).argmax(dim=-1)

        drafts, starts = draft_token_ids.tolist(), layout.draft_start.tolist()
        counts, extra = num_accepted.tolist(), final.tolist()
        outputs = [drafts[s:s + a] + [f] for s, a, f in zip(starts, counts, extra)]
        return RejectionOutput(output_token_ids=outputs, num_accepted=counts)

    @staticmethod
    def _residual_logits(
        proc: torch.Tensor,  # [n, vocab] float32, processed target logits of the rejecting rows
        lse: torch.Tensor,  # [n] float32, their logsumexp
        rejected: torch.Tensor,  # [n] int64, the rejected draft tokens
        draft_dists: torch.Tensor | None,  # [n, vocab] float32 q, or None: q = point mass on ``rejected``
    ) -> torch.Tensor:
        """Logits (up to a per-row constant) of norm(max(p - q, 0)), ``[n, vocab]``.

        A row whose residual is all zero (p <= q everywhere, which only rounding can make
        rejectable) falls back to p.
        """
        rows = torch.arange(proc.shape[0], device=proc.device)
        if draft_dists is None:
            residual = proc.clone()
            residual[rows, rejected] = -torch.inf
        else:
            p = (proc - lse.unsqueeze(-1)).exp_()
            residual = p.sub_(draft_dists.float()).clamp_(min=0).log_()
        empty = torch.isneginf(residual.amax(dim=-1))  # [n]
        if bool(empty.any()):
            residual = torch.where(empty.unsqueeze(-1), proc, residual)
        return residual
