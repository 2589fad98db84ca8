import math

import pytest
import torch

from tpspec.sample.gumbel import SAMPLE, gumbel, uniform
from tpspec.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p_min_p, apply_top_p
from tpspec.sampling_params import SamplingParams

LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
DRAWS = 20000


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def goodness_of_fit_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of integer samples against probs; samples off the support give 0."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    expected = probs[support].double() * samples.numel()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


def metadata(params: list[SamplingParams], seeds=None, positions=None, **_) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, seeds or [0] * n, positions or list(range(n)))


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """DRAWS samples of one distribution, using the position as the counter."""
    md = SamplingMetadata.from_params([params] * DRAWS, [seed] * DRAWS, list(range(DRAWS)))
    return Sampler()(logits.expand(DRAWS, -1), md).sampled_token_ids


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    out = Sampler()(logits, metadata([SamplingParams(temperature=0)] * 3))
    assert out.sampled_token_ids.tolist() == [1, 0, 0]
    assert out.logprobs is None


def test_temperature_sampling_matches_softmax():
    temperature = 0.7
    target = torch.softmax(LOGITS8 / temperature, dim=-1)
    samples = draw(LOGITS8, SamplingParams(temperature=temperature, seed=1))
    assert goodness_of_fit_p(samples, target) > 1e-4

    # Broken samplers, built from the same noise, fail the same test: the threshold bites.
    positions = torch.arange(DRAWS, dtype=torch.int64)
    seeds = torch.full((DRAWS,), 0, dtype=torch.int64)
    vocab = torch.arange(8, dtype=torch.int64)
    g = gumbel(seeds, positions, vocab, SAMPLE)
    forgot_temperature = (LOGITS8 + g).argmax(-1)
    uniform_noise = (LOGITS8 / temperature + uniform(seeds, positions, vocab, SAMPLE)).argmax(-1)
    noise_shared_by_tokens = (LOGITS8 / temperature + g[:, :1]).argmax(-1)
    for broken in (forgot_temperature, uniform_noise, noise_shared_by_tokens):
        assert goodness_of_fit_p(broken, target) < 1e-6


def reference_keep(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Straightforward float64 reference of the documented filters, ties included."""
    x = [float(v) for v in logits.double()]
    keep = set(range(len(x)))
    if top_k > 0:
        kth = sorted(x, reverse=True)[min(top_k, len(x)) - 1]
        keep = {i for i in keep if x[i] >= kth}
    if top_p < 1:
        z = sum(math.exp(x[i]) for i in keep)
        order = sorted(keep, key=lambda i: -x[i])
        cum, last = 0.0, order[-1]
        for i in order:
            cum += math.exp(x[i]) / z
            if cum >= top_p:
                last = i
                break
        keep = {i for i in keep if x[i] >= x[last]}
    if min_p > 0:
        p_max = max(math.exp(x[i]) for i in keep)
        keep = {i for i in keep if math.exp(x[i]) >= min_p * p_max}
    return keep


def test_filter_examples_with_ties():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    def kept(top_k=0, top_p=1.0, min_p=0.0):
        out = apply_top_k_top_p_min_p(logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return set(torch.nonzero(out[0] > -math.inf).flatten().tolist())

    assert kept(top_k=2) == {0, 1, 2, 3}  # every token equal to the 2nd value survives
    assert kept(top_k=1) == {0}
    assert kept(top_k=100) == set(range(6))
    assert kept(top_p=0.3) == {0}  # p(0) = 0.45 alone reaches 0.3
    assert kept(top_p=0.5) == {0, 1, 2, 3}  # the prefix ends inside the tie: keep the tie
    assert kept(min_p=1.0) == {0}
    assert kept(min_p=math.exp(-1.0) - 1e-6) == {0, 1, 2, 3}
    assert kept(top_k=4, top_p=0.99) == {0, 1, 2, 3}  # top-p renormalises over top-k's set


def test_filters_match_reference_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    rows = 400
    logits = torch.randint(-6, 7, (rows, 12), generator=gen).float() / 2  # many ties
    top_k = torch.randint(0, 8, (rows,), generator=gen)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.98 + 0.01)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.9)
    out = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    checked = 0
    for r in range(rows):
        k, p, m = int(top_k[r]), float(top_p[r]), float(min_p[r])
        if _near_boundary(logits[r], k, p, m):
            continue
        assert set(torch.nonzero(out[r] > -math.inf).flatten().tolist()) == reference_keep(logits[r], k, p, m), r
        assert bool((out[r][out[r] > -math.inf] == logits[r][out[r] > -math.inf]).all())
        checked += 1
    assert checked > 350


def _near_boundary(logits: torch.Tensor, k: int, p: float, m: float, eps: float = 1e-5) -> bool:
    """Whether float32 rounding could flip a top-p or min-p decision on this row."""
    nudged = [reference_keep(logits, k, p + d, m + e) for d in (-eps, 0, eps) for e in (-eps, 0, eps)
              if 0 < p + d <= 1 and 0 <= m + e <= 1]
    return any(s != nudged[0] for s in nudged)


def test_top_p_over_a_large_flat_vocab_matches_full_sort():
    """Nuclei larger than every candidate stage take the full-sort path with the same rule."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen) * torch.tensor([[0.1], [0.5], [1], [3], [8], [0.01]])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 0.7, 0.999])
    out = apply_top_p(logits, top_p)
    for r in range(6):
        sorted_logits = torch.sort(logits[r], descending=True).values
        # The rule on the whole sorted row, with the documented fixed-point masses
        # (round(exp(x - M) * 2^38) in float32, integer sums): exact, so the staged search must match it.
        weights = torch.round(torch.exp(sorted_logits - sorted_logits[0]) * 2.0**38).long()
        cum = weights.cumsum(0)
        length = int((cum.double() < top_p[r].double() * float(cum[-1])).sum()) + 1
        kept = int((out[r] > -math.inf).sum())
        assert kept == length, (r, kept, length)
        assert bool((out[r][logits[r] >= sorted_logits[kept - 1]] > -math.inf).all())
        exact = torch.softmax(logits[r].double(), -1).sort(descending=True).values.cumsum(0)
        assert abs(kept - (int((exact < top_p[r].double()).sum()) + 1)) <= 2  # and it is the real nucleus


def test_sampling_with_filters_matches_renormalised_distribution():
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.85, min_p=0.1)
    samples = draw(LOGITS8, params)
    keep = reference_keep(LOGITS8 / 0.9, 5, 0.85, 0.1)
    mask = torch.tensor([i in keep for i in range(8)])
    target = torch.softmax((LOGITS8 / 0.9).masked_fill(~mask, -math.inf), -1)
    assert goodness_of_fit_p(samples, target) > 1e-4
    # Without the filters the same samples would be off-support or mis-weighted.
    assert goodness_of_fit_p(draw(LOGITS8, SamplingParams(temperature=0.9)), target) < 1e-6


def test_same_seed_and_position_same_token_regardless_of_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 1000, generator=gen)
    params = [SamplingParams(temperature=1.0, top_k=50 * (i % 3), top_p=1.0 - 0.1 * (i % 2)) for i in range(16)]
    seeds, positions = [1000 + i for i in range(16)], [7 * i for i in range(16)]
    batch = Sampler()(logits, SamplingMetadata.from_params(params, seeds, positions)).sampled_token_ids
    for i in (0, 5, 11):
        alone = Sampler()(logits[i:i + 1], SamplingMetadata.from_params([params[i]], [seeds[i]], [positions[i]]))
        assert alone.sampled_token_ids.item() == batch[i].item()
    again = Sampler()(logits.clone(), SamplingMetadata.from_params(params, seeds, positions)).sampled_token_ids
    assert torch.equal(again, batch)


def test_different_seeds_give_different_draws():
    flat = torch.zeros(100)
    a = draw(flat, SamplingParams(), seed=1)[:500]
    b = draw(flat, SamplingParams(), seed=2)[:500]
    assert float((a == b).float().mean()) < 0.05  # ~1% expected for independent draws
    assert torch.equal(draw(flat, SamplingParams(), seed=2 + 2**64)[:500], b)  # seeds are taken mod 2^64


def test_mixed_greedy_and_random_rows():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=gen)
    params = [SamplingParams(temperature=0 if i % 2 else 1.3, top_p=0.9) for i in range(6)]
    seeds, positions = list(range(6)), [40] * 6
    out = Sampler()(logits, SamplingMetadata.from_params(params, seeds, positions)).sampled_token_ids
    for i in range(6):
        alone = Sampler()(logits[i:i + 1], SamplingMetadata.from_params([params[i]], [seeds[i]], [positions[i]]))
        assert alone.sampled_token_ids.item() == out[i].item()
        if i % 2:
            assert out[i].item() == logits[i].argmax().item()


def test_logprobs_are_log_softmax_of_raw_logits():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=gen) * 2
    logits[0, 10] = logits[0, 20] = logits[0, 30] = 50.0  # a three-way tie at the top
    params = [SamplingParams(temperature=0.5, logprobs=3), SamplingParams(temperature=0, logprobs=1),
              SamplingParams(temperature=2.0, top_k=5), SamplingParams(temperature=0, logprobs=0)]
    out = Sampler()(logits, metadata(params))
    expected = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.topk_logprobs.shape == (4, 3) and lp.topk_token_ids.shape == (4, 3)
    assert torch.allclose(lp.token_logprob, expected.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.allclose(lp.topk_logprobs, expected.topk(3, dim=-1).values)
    assert torch.equal(lp.topk_logprobs, expected.gather(1, lp.topk_token_ids))
    assert lp.topk_token_ids[0].tolist() == [10, 20, 30]  # ties ordered by lowest id
    assert out.sampled_token_ids[0].item() in (10, 20, 30)


def test_top_logprobs_tie_across_the_boundary_keeps_lowest_ids():
    logits = torch.zeros(3, 40)
    logits[0, [33, 5, 17, 2, 29]] = 4.0  # five-way tie for three places
    logits[1, 7], logits[1, [30, 3, 12]] = 9.0, 1.0  # one clear winner, then a three-way tie
    out = Sampler()(logits, metadata([SamplingParams(temperature=0, logprobs=3)] * 3))
    assert out.logprobs.topk_token_ids.tolist() == [[2, 5, 17], [7, 3, 12], [0, 1, 2]]


def test_no_logprobs_requested_zero_means_sampled_only():
    logits = torch.randn(2, 50)
    assert Sampler()(logits, metadata([SamplingParams()] * 2)).logprobs is None
    out = Sampler()(logits, metadata([SamplingParams(logprobs=0)] * 2))
    assert out.logprobs is not None and out.logprobs.topk_logprobs.shape == (2, 0)


def test_metadata_flags():
    md = metadata([SamplingParams(temperature=0), SamplingParams(top_k=3)])
    assert not md.all_greedy and not md.all_random and not md.no_top_k_top_p_min_p
    md = metadata([SamplingParams(temperature=0)] * 2)
    assert md.all_greedy and md.no_top_k_top_p_min_p and md.max_num_logprobs is None


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="lengths"):
        SamplingMetadata.from_params([SamplingParams()], [0, 1], [0])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(3, 10), metadata([SamplingParams()] * 2))
    md = metadata([SamplingParams()])
    with pytest.raises(ValueError, match="seeds"):
        SamplingMetadata(**{**md.__dict__, "seeds": torch.zeros(1, dtype=torch.int32)})
