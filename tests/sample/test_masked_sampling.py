"""Sampling under a grammar mask follows the masked, renormalized target distribution, for plain
sampling (with and without top-k) and for speculative verification of drafts drawn from a masked
draft distribution; deliberately broken samplers (mask applied after sampling, renormalization
skipped, filters before the mask) fail the same test."""

from __future__ import annotations

import math

import pytest
import torch

from tpspec.sample import token_bitmask
from tpspec.sample.sampler import Sampler, SamplingMetadata
from tpspec.sampling_params import SamplingParams
from tpspec.spec_decode.rejection_sampler import RejectionSampler

LOGITS = torch.tensor([1.4, 0.2, -0.3, 0.9, 0.5, 1.1, -1.0, 0.0])
DRAFT = torch.tensor([0.0, 1.2, 0.4, -0.2, 1.0, 0.3, 0.0, 0.6])  # a different draft model
ALLOWED = [1, 3, 4, 6, 7]
N = 20_000


def _bitmask(rows: int) -> torch.Tensor:
    word = sum(1 << t for t in ALLOWED)
    return torch.full((rows, 1), word, dtype=torch.int32)


def _metadata(params: SamplingParams, rows: int, repeat: int = 1) -> SamplingMetadata:
    """Request i has seed i; ``repeat`` consecutive rows per request at positions 0, 1, …"""
    n = rows // repeat
    seeds = [i for i in range(n) for _ in range(repeat)]
    positions = [j for _ in range(n) for j in range(repeat)]
    return SamplingMetadata.from_params([params] * rows, seeds, positions)


def _expected(top_k: int = 0) -> torch.Tensor:
    masked = torch.full_like(LOGITS, -math.inf)
    masked[ALLOWED] = LOGITS[ALLOWED]
    if top_k:
        masked[masked < masked.topk(top_k).values[-1]] = -math.inf
    return torch.softmax(masked, -1)


def _chi2_ok(tokens: torch.Tensor, expected: torch.Tensor) -> bool:
    """Pearson's χ² over the tokens ``expected`` allows (none other may occur) below its 99.99 %
    point for these few degrees of freedom (< 25 with 5 cells)."""
    counts = torch.bincount(tokens, minlength=expected.numel()).float()
    support = expected > 0
    if counts[~support].sum() > 0:
        return False
    e = expected[support] * tokens.numel()
    return float(((counts[support] - e) ** 2 / e).sum()) < 25.0


def _masked_sample(params: SamplingParams) -> torch.Tensor:
    logits = LOGITS.repeat(N, 1)
    token_bitmask.apply(logits, _bitmask(N))
    return Sampler()(logits, _metadata(params, N), with_logprobs=False).sampled_token_ids


def _broken_mask_after_sampling(params: SamplingParams) -> torch.Tensor:
    """Samples the unmasked row, then replaces a forbidden token by the best allowed one."""
    out = Sampler()(LOGITS.repeat(N, 1), _metadata(params, N), with_logprobs=False).sampled_token_ids
    best = max(ALLOWED, key=lambda t: LOGITS[t])
    return torch.where(torch.isin(out, torch.tensor(ALLOWED)), out, best)


def _broken_no_renormalization(params: SamplingParams) -> torch.Tensor:
    """Keeps the allowed tokens' unmasked probabilities; the forbidden mass stays on the first allowed token."""
    p = torch.softmax(LOGITS, -1)
    q = torch.zeros_like(p)
    q[ALLOWED] = p[ALLOWED]
    q[ALLOWED[0]] += 1 - q.sum()
    return torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(0))


def _broken_filter_before_mask(params: SamplingParams) -> torch.Tensor:
    """top-k over the unmasked row, then the mask: fewer than k tokens survive."""
    logits = LOGITS.repeat(N, 1)
    logits[logits < LOGITS.topk(params.top_k).values[-1]] = -math.inf
    token_bitmask.apply(logits, _bitmask(N))
    return Sampler()(logits, _metadata(SamplingParams(temperature=1.0), N), with_logprobs=False).sampled_token_ids


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampling_under_a_mask_follows_the_masked_distribution(top_k):
    params = SamplingParams(temperature=1.0, top_k=top_k)
    assert _chi2_ok(_masked_sample(params), _expected(top_k))
    assert not _chi2_ok(_broken_mask_after_sampling(params), _expected(top_k))
    if top_k:
        assert not _chi2_ok(_broken_filter_before_mask(params), _expected(top_k))
    else:
        assert not _chi2_ok(_broken_no_renormalization(params), _expected(top_k))


def test_greedy_under_a_mask_takes_the_best_allowed_token():
    logits = LOGITS.repeat(2, 1)
    token_bitmask.apply(logits, _bitmask(2))
    out = Sampler()(logits, _metadata(SamplingParams(temperature=0), 2), with_logprobs=False).sampled_token_ids
    assert out.tolist() == [max(ALLOWED, key=lambda t: LOGITS[t])] * 2


def _verified_first_tokens(mask_target: bool) -> torch.Tensor:
    """One draft per request, drawn from the masked draft distribution q; the first emitted token
    of each of N verifications (accepted draft or recovered token)."""
    q_logits = DRAFT.clone()
    forbidden = torch.ones_like(q_logits, dtype=torch.bool)
    forbidden[ALLOWED] = False
    q = torch.softmax(q_logits.masked_fill(forbidden, -math.inf), -1)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
    target = LOGITS.repeat(2 * N, 1)  # rows: the draft's position, then the bonus position
    if mask_target:
        token_bitmask.apply(target, _bitmask(2 * N))
    md = _metadata(SamplingParams(temperature=1.0), 2 * N, repeat=2)
    out = RejectionSampler()(target, drafts, [1] * N, md, draft_probs=q[drafts], draft_dists=q.repeat(N, 1))
    return torch.tensor([o[0] for o in out.output_token_ids])


def test_verification_under_a_mask_keeps_the_masked_target_distribution():
    assert _chi2_ok(_verified_first_tokens(mask_target=True), _expected())
    assert not _chi2_ok(_verified_first_tokens(mask_target=False), _expected())  # the verifier must mask too
