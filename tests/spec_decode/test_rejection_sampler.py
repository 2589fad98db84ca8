"""RejectionSampler: greedy = plain greedy, k = 0 = the plain Sampler, and speculative sampling
keeps the target's distribution (joint of consecutive tokens), while deliberately broken
verifiers, run through the same harness, fail the same statistical test."""


import dataclasses

import pytest
import torch

from tpspec.sample.gumbel import ACCEPT, DRAFT, RESIDUAL, SAMPLE, gumbel, uniform
from tpspec.sample.sampler import Sampler, SamplingMetadata, processed_logits
from tpspec.sampling_params import SamplingParams
from tpspec.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every tensor here is small: intra-op threads only add overhead (a lot on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def row_metadata(params, seeds, positions) -> SamplingMetadata:
    """One metadata row per target row: params[i] / seeds[i] per request, positions per row."""
    return SamplingMetadata.from_params(params, seeds, positions)


def request_rows(ks, params, seeds, first_positions):
    """Expand per-request settings to per-row metadata (k_i + 1 rows each)."""
    p, s, pos = [], [], []
    for k, pr, sd, start in zip(ks, params, seeds, first_positions):
        p += [pr] * (k + 1)
        s += [sd] * (k + 1)
        pos += list(range(start, start + k + 1))
    return row_metadata(p, s, pos)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------

def test_greedy_accepts_the_matching_prefix_then_emits_the_argmax():
    gen = torch.Generator().manual_seed(0)
    vocab, n = 50, 40
    ks = torch.randint(0, 6, (n,), generator=gen).tolist()
    rows = sum(ks) + n
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # many ties
    top = logits.argmax(-1)
    drafts, expected, expected_accepted, r = [], [], [], 0
    for k in ks:
        a = int(torch.randint(0, k + 1, (1,), generator=gen))  # drafts that match: a prefix of a
        d = top[r:r + k].clone()
        if a < k:
            d[a] = (d[a] + 1 + torch.randint(0, vocab - 1, (1,), generator=gen)) % vocab  # a mismatch
            d[a + 1:] = torch.randint(0, vocab, (k - a - 1,), generator=gen)
        drafts.append(d)
        expected.append(top[r:r + a + 1].tolist())
        expected_accepted.append(a)
        r += k + 1
    md = request_rows(ks, [GREEDY] * n, list(range(n)), [5] * n)
    out = RejectionSampler()(logits, torch.cat(drafts), ks, md)
    assert isinstance(out, RejectionOutput)
    assert out.num_accepted == expected_accepted
    assert out.output_token_ids == expected
    # All greedy takes one argmax over every row; the position-by-position path (taken when some
    # request samples) gives the same.
    loop = RejectionSampler()(logits, torch.cat(drafts), ks, dataclasses.replace(md, all_greedy=False))
    assert (loop.num_accepted, loop.output_token_ids) == (expected_accepted, expected)
    assert all(len(o) == a + 1 for o, a in zip(out.output_token_ids, out.num_accepted))
    # Ties go to the lowest id, as in the Sampler.
    plain = Sampler()(logits, md).sampled_token_ids.tolist()
    r = 0
    for k, o in zip(ks, out.output_token_ids):
        assert o == plain[r:r + len(o)]
        r += k + 1


# A Markov-chain "model" over a tiny vocabulary: the target's and the draft's next-token logits
# depend on the previous token only. Speculative decoding over it is then a full decoding loop.
V = 6
TARGET = torch.tensor([
    [1.2, 0.3, -0.4, 0.8, 0.0, -1.0],
    [0.0, 1.0, 0.5, -0.5, 0.3, 0.6],
    [-0.6, 0.2, 1.1, 0.4, 0.9, 0.0],
    [0.7, -0.3, 0.0, 1.0, -0.2, 0.5],
    [0.1, 0.6, -0.8, 0.2, 1.3, 0.4],
    [0.5, 0.0, 0.9, -0.4, 0.1, 1.0],
])
DRAFT_LOGITS = torch.tensor([  # a deliberately different draft
    [0.0, 1.5, 0.2, -0.5, 0.8, 0.3],
    [1.0, -0.5, 0.0, 1.2, 0.0, -0.3],
    [0.4, 1.0, -0.5, 0.0, 0.3, 1.1],
    [-0.2, 0.8, 1.0, 0.0, 0.9, -0.6],
    [1.1, 0.0, 0.5, 0.7, -0.9, 0.2],
    [0.0, 0.9, -0.2, 1.2, 0.6, -0.4],
])


def simulate(verify, params: SamplingParams, k: int, num_tokens: int, n: int,
             draft_mode: str = "probabilistic", seed_base: int = 0, k_of=None) -> torch.Tensor:
    """Speculatively decode ``num_tokens`` tokens for n requests (prompt ends in token 0).

    ``draft_mode``: "probabilistic" draws drafts from softmax(DRAFT_LOGITS[prev]) with the DRAFT
    noise stream and passes q; "greedy" proposes argmax(DRAFT_LOGITS[prev]) (q = point mass).
    ``k_of(step, n)``, if given: each request's number of drafts at that step (0 … k), in place of
    k for all. Returns ``[n, num_tokens]`` int64.
    """
    seeds = torch.arange(n, dtype=torch.int64) + seed_base
    last = torch.zeros(n, dtype=torch.int64)
    pos = torch.full((n,), 10, dtype=torch.int64)
    out = [[] for _ in range(n)]
    ids = torch.arange(V)
    step = 0
    while min(len(o) for o in out) < num_tokens:
        ks = [k] * n if k_of is None else k_of(step, n)
        step += 1
        prev, drafts, dists = last, [], []
        for j in range(max(ks)):
            q_logits = DRAFT_LOGITS[prev]  # [n, V]
            if draft_mode == "probabilistic":
                d = (torch.log_softmax(q_logits, -1) + gumbel(seeds, pos + j, ids, DRAFT)).argmax(-1)
                dists.append(torch.softmax(q_logits, -1))
            else:
                d = q_logits.argmax(-1)
            drafts.append(d)
            prev = d
        chain = torch.stack([last] + drafts, 1)  # [n, max k + 1]: the token before each target row
        # Request i verifies its first ks[i] drafts: rows chain[i, 0 … ks[i]], request by request.
        verified = torch.arange(max(ks) + 1) <= torch.tensor(ks)[:, None]  # [n, max k + 1]
        target = TARGET[chain[verified]]
        draft_ids = chain[:, 1:][verified[:, 1:]]
        q = torch.stack(dists, 1)[verified[:, 1:]] if dists and sum(ks) else None
        q_d = q.gather(1, draft_ids[:, None])[:, 0] if q is not None else None
        rows = sum(ks) + n
        counts = torch.tensor(ks) + 1
        md = SamplingMetadata(
            temperature=torch.full((rows,), params.temperature),
            top_k=torch.full((rows,), params.top_k, dtype=torch.int64),
            top_p=torch.full((rows,), params.top_p),
            min_p=torch.full((rows,), params.min_p),
            seeds=seeds.repeat_interleave(counts),
            positions=pos.repeat_interleave(counts) + torch.arange(rows) - (counts.cumsum(0) - counts).repeat_interleave(counts),
            max_num_logprobs=None, all_greedy=params.is_greedy, all_random=not params.is_greedy,
            no_top_k_top_p_min_p=params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0,
        )
        res = verify(target, draft_ids, ks, md, q_d, q)
        for i, toks in enumerate(res.output_token_ids):
            out[i].extend(toks)
        last = torch.tensor([o[-1] for o in out])
        pos = pos + torch.tensor([len(t) for t in res.output_token_ids])
    return torch.tensor([o[:num_tokens] for o in out])


def test_greedy_speculative_decoding_equals_plain_greedy_decoding():
    for k in (0, 1, 3, 5):
        for mode in ("probabilistic", "greedy"):
            spec = simulate(RejectionSampler(), GREEDY, k, 12, 64, mode)
            plain = simulate(RejectionSampler(), GREEDY, 0, 12, 64)
            seq = [0]
            for _ in range(12):
                seq.append(int(TARGET[seq[-1]].argmax()))
            assert torch.equal(spec, plain)
            assert spec[0].tolist() == seq[1:]


# --------------------------------------------------------------------------------------------
# k = 0 and bonus rows: the plain Sampler, bit for bit
# --------------------------------------------------------------------------------------------

def mixed_params(n):
    choices = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
               SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.05),
               SamplingParams(temperature=0.5, top_k=100, top_p=0.95, min_p=0.01)]
    return [choices[i % len(choices)] for i in range(n)]


def test_k_zero_is_the_plain_sampler():
    gen = torch.Generator().manual_seed(1)
    n, vocab = 48, 3000
    logits = torch.randn(n, vocab, generator=gen) * 2
    params = mixed_params(n)
    md = row_metadata(params, [7 * i + 1 for i in range(n)], [100 + i for i in range(n)])
    out = RejectionSampler()(logits, torch.zeros(0, dtype=torch.int64), [0] * n, md)
    plain = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out.output_token_ids == [[t] for t in plain]
    assert out.num_accepted == [0] * n
    for kind in ([SamplingParams(temperature=0.8)] * n, [GREEDY] * n):  # all-random / all-greedy paths
        md = row_metadata(kind, list(range(n)), [3] * n)
        out = RejectionSampler()(logits, torch.zeros(0, dtype=torch.int64), [0] * n, md)
        assert out.output_token_ids == [[t] for t in Sampler()(logits, md).sampled_token_ids.tolist()]


def test_bonus_token_is_the_plain_samplers_draw_and_batch_does_not_matter():
    gen = torch.Generator().manual_seed(2)
    n, vocab = 60, 500
    ks = [i % 4 for i in range(n)]
    rows = sum(ks) + n
    logits = torch.randn(rows, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (sum(ks),), generator=gen)
    r = d = 0
    for k in ks:  # make most drafts likely under the target, so that many requests reach the bonus
        logits[torch.arange(r, r + k), drafts[d:d + k]] += 8.0
        r, d = r + k + 1, d + k
    params = mixed_params(n)
    seeds, starts = [11 * i for i in range(n)], [20 + 3 * i for i in range(n)]
    md = request_rows(ks, params, seeds, starts)
    out = RejectionSampler()(logits, drafts, ks, md)
    plain = Sampler()(logits, md).sampled_token_ids.tolist()
    r = d = bonus = 0
    for i, k in enumerate(ks):
        toks, a = out.output_token_ids[i], out.num_accepted[i]
        assert len(toks) == a + 1 and toks[:a] == drafts[d:d + a].tolist()
        if a == k:
            assert toks[-1] == plain[r + k]
            bonus += k > 0
        # The same request alone gives the same tokens: no dependence on the rest of the batch.
        if i % 7 == 0:
            alone = RejectionSampler()(logits[r:r + k + 1], drafts[d:d + k], [k],
                                       request_rows([k], [params[i]], [seeds[i]], [starts[i]]))
            assert alone.output_token_ids == [toks]
        r, d = r + k + 1, d + k
    assert bonus >= 20


def test_probabilistic_drafts_with_batch_mixing_greedy_requests():
    gen = torch.Generator().manual_seed(3)
    n, vocab, k = 30, 200, 3
    logits = torch.randn(n * (k + 1), vocab, generator=gen)
    q = torch.softmax(torch.randn(n * k, vocab, generator=gen), -1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    params = mixed_params(n)
    md = request_rows([k] * n, params, list(range(n)), [0] * n)
    out = RejectionSampler()(logits, drafts, [k] * n, md, q.gather(1, drafts[:, None])[:, 0], q)
    random_rejections = 0
    for i in range(n):
        a, toks, mine = out.num_accepted[i], out.output_token_ids[i], slice(i * k, (i + 1) * k)
        assert len(toks) == a + 1 and toks[:a] == drafts[mine][:a].tolist()
        if params[i].is_greedy:  # greedy requests ignore q
            top = logits[i * (k + 1):(i + 1) * (k + 1)].argmax(-1).tolist()
            assert toks == top[:a + 1]
            assert drafts[i * k:i * k + a].tolist() == top[:a]
            continue
        # A random request draws what it draws alone: nothing of the greedy rows or q leaks in.
        alone = RejectionSampler()(logits[i * (k + 1):(i + 1) * (k + 1)], drafts[mine], [k],
                                   request_rows([k], [params[i]], [i], [0]), q[mine].gather(1, drafts[mine, None])[:, 0], q[mine])
        assert (alone.output_token_ids, alone.num_accepted) == ([toks], [a])
        if a < k:  # drawn from norm(max(p - q, 0)), which is zero at a rejected draft
            random_rejections += 1
            assert toks[a] != drafts[i * k + a]
    assert random_rejections >= 10


def test_one_hot_draft_dists_agree_with_greedy_drafts():
    """The model runner mixes greedy drafts into a probabilistic batch as one-hot q rows."""
    gen = torch.Generator().manual_seed(4)
    n, vocab, k = 200, 1000, 3
    logits = torch.randn(n * (k + 1), vocab, generator=gen) * 2
    drafts = torch.randint(0, vocab, (n * k,), generator=gen)
    logits[(torch.arange(n)[:, None] * (k + 1) + torch.arange(k)).reshape(-1), drafts] += 10.0
    md = request_rows([k] * n, [SamplingParams(temperature=1.0)] * n, list(range(n)), [50] * n)
    point = RejectionSampler()(logits, drafts, [k] * n, md)
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    dense = RejectionSampler()(logits, drafts, [k] * n, md, torch.ones(n * k), one_hot)
    assert point.num_accepted == dense.num_accepted
    assert 0 < sum(a < k for a in point.num_accepted) < n  # both rejections and bonus tokens occur
    assert point.output_token_ids == dense.output_token_ids  # the same residual, bit for bit


def test_bad_inputs_raise():
    rs = RejectionSampler()
    md = request_rows([2], [SamplingParams()], [0], [0])
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="target_logits"):
        rs(torch.randn(4, 10), torch.tensor([1, 2]), [2], md)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rs(logits, torch.tensor([1]), [2], md)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rs(logits, torch.tensor([1, 10]), [2], md)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rs(logits, torch.tensor([1, 2]), [-1], md)
    with pytest.raises(ValueError, match="draft_dists"):
        rs(logits, torch.tensor([1, 2]), [2], md, draft_probs=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="metadata"):
        rs(logits, torch.tensor([1, 2]), [2], request_rows([1], [SamplingParams()], [0], [0]))
    empty = row_metadata([], [], [])
    assert rs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), [], empty) == RejectionOutput([], [])


# --------------------------------------------------------------------------------------------
# Sampling losslessness, with broken verifiers as controls
# --------------------------------------------------------------------------------------------

def broken_verifier(bug: str):
    """A straightforward verifier (uniform k, all requests random) with one deliberate bug.

    - "residual_abs": resample from |p - q| instead of max(p - q, 0);
    - "residual_floor": resample from max(p - q, 0.02), a subtly different clamp;
    - "residual_p": resample from p (forgets to subtract q);
    - "accept_p": accept with probability p(d), ignoring q;
    - "bonus_from_q": the bonus token drawn from the last draft row's q instead of p;
    - "shared_uniform": the residual drawn by inverse CDF from the very uniform that rejected;
    - "accept_raw_p": acceptance from the unfiltered softmax(logits / T) (top-k/top-p ignored).
    ("accept with p/q, no min" is not a bug: u < 1, so u < p/q and u < min(1, p/q) agree.)
    """

    def verify(target_logits, draft_ids, ks, md, draft_probs, draft_dists):
        n, k, vocab = len(ks), ks[0], target_logits.shape[1]
        proc = processed_logits(target_logits, md).view(n, k + 1, vocab)
        p = torch.softmax(proc, -1)
        seeds, positions = md.seeds.view(n, k + 1), md.positions.view(n, k + 1)
        d = draft_ids.view(n, k)
        q = (draft_dists.view(n, k, vocab) if draft_dists is not None
             else torch.nn.functional.one_hot(d, vocab).float())
        p_acc = p
        if bug == "accept_raw_p":
            p_acc = torch.softmax(target_logits / md.temperature[:, None], -1).view(n, k + 1, vocab)
        p_d = p_acc[:, :k].gather(2, d[..., None])[..., 0]
        q_d = q.gather(2, d[..., None])[..., 0]
        u = torch.stack([uniform(seeds[:, j], positions[:, j], d[:, j:j + 1], ACCEPT)[:, 0] for j in range(k)], 1) \
            if k else torch.zeros(n, 0)
        accepted = u < (p_d if bug == "accept_p" else torch.clamp(p_d / q_d, max=1.0))
        first_reject = torch.cat([~accepted, torch.ones(n, 1, dtype=torch.bool)], 1).int().argmax(1)
        rows = torch.arange(n)
        j = first_reject
        ids = torch.arange(vocab)
        bonus_logits = proc[:, k]
        if bug == "bonus_from_q" and k:
            bonus_logits = q[:, k - 1].log()
        bonus = (bonus_logits + gumbel(seeds[:, k], positions[:, k], ids, SAMPLE)).argmax(-1)
        jj = j.clamp(max=max(k - 1, 0))
        if k:
            p_j, q_j = p[rows, jj], q[rows, jj]
            residual = {
                "residual_abs": (p_j - q_j).abs(),
                "residual_floor": (p_j - q_j).clamp(min=0.02),
                "residual_p": p_j,
            }.get(bug, (p_j - q_j).clamp(min=0))
            if bug == "shared_uniform":
                cdf = (residual / residual.sum(-1, keepdim=True)).cumsum(-1)
                recovered = (cdf <= u[rows, jj][:, None]).sum(-1).clamp(max=vocab - 1)
            else:
                noise = gumbel(seeds[rows, jj], positions[rows, jj], ids, RESIDUAL)
                recovered = (residual.log() + noise).argmax(-1)
        last = torch.where(j == k, bonus, recovered) if k else bonus
        counts = j.tolist()
        outputs = [ds[:a] + [t] for ds, a, t in zip(d.tolist(), counts, last.tolist())]
        return RejectionOutput(outputs, counts)

    return verify


def chi2_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of integer samples (cells) against probs (exact sf)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    expected = probs[support].double() * samples.numel()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def target_chain(params: SamplingParams) -> torch.Tensor:
    """P[prev] = the target's processed next-token distribution, ``[V, V]``."""
    md = SamplingMetadata.from_params([params] * V, [0] * V, [0] * V)
    return torch.softmax(processed_logits(TARGET, md), -1)


def fit(tokens: torch.Tensor, params: SamplingParams) -> dict[str, float]:
    """p-values of the first token, the (x0, x1) joint and the (x1, x2) joint."""
    P = target_chain(params)
    m0 = P[0]
    joint01 = m0[:, None] * P
    m1 = joint01.sum(0)
    joint12 = m1[:, None] * P
    return {
        "x0": chi2_p_value(tokens[:, 0], m0),
        "x0x1": chi2_p_value(tokens[:, 0] * V + tokens[:, 1], joint01.reshape(-1)),
        "x1x2": chi2_p_value(tokens[:, 1] * V + tokens[:, 2], joint12.reshape(-1)),
    }


TRIALS = 24000
BROKEN_TRIALS = 8000  # the controls miss by hundreds of orders of magnitude at TRIALS
PASS, FAIL = 1e-3, 1e-8  # fixed seeds: deterministic; the real sampler passes every test


def simulate_with_accept_stream_reused(monkeypatch, *args, **kwargs) -> torch.Tensor:
    """The real sampler, broken: u keyed by a fixed token id (0) instead of the draft's, and the
    residual's Gumbel noise taken from the ACCEPT stream. A rejection means u_0 was large, so
    token 0's residual noise is large too. (With u keyed by the draft id, as in the real
    sampler, the one correlated noise entry is the draft's own, which the residual excludes.)"""
    import tpspec.spec_decode.rejection_sampler as module

    with monkeypatch.context() as m:
        m.setattr(module, "RESIDUAL", ACCEPT)
        m.setattr(module, "uniform", lambda s, p, ids, stream: uniform(s, p, torch.zeros_like(ids), stream))
        return simulate(RejectionSampler(), *args, **kwargs)


@pytest.mark.parametrize("k", [1, 2])
def test_probabilistic_drafts_preserve_the_target_distribution(k, monkeypatch):
    params = SamplingParams(temperature=1.0)
    real = fit(simulate(RejectionSampler(), params, k, 3, TRIALS), params)
    assert min(real.values()) > PASS, real
    # The harness is fair: a straightforward correct verifier passes too, and agrees exactly.
    ref = simulate(broken_verifier("none"), params, k, 3, 3000)
    assert torch.equal(ref, simulate(RejectionSampler(), params, k, 3, 3000))
    for bug in ("residual_abs", "residual_floor", "residual_p", "accept_p", "bonus_from_q", "shared_uniform"):
        broken = fit(simulate(broken_verifier(bug), params, k, 3, BROKEN_TRIALS), params)
        assert min(broken.values()) < FAIL, (bug, broken)
    broken = fit(simulate_with_accept_stream_reused(monkeypatch, params, k, 3, BROKEN_TRIALS), params)
    assert min(broken.values()) < FAIL, ("accept_stream_reused", broken)


def test_greedy_drafts_preserve_the_target_distribution(monkeypatch):
    params = SamplingParams(temperature=0.8)
    real = fit(simulate(RejectionSampler(), params, 2, 3, TRIALS, "greedy"), params)
    assert min(real.values()) > PASS, real
    # ("accept_p" is the right rule here: q(d) = 1.)
    for bug in ("residual_p", "shared_uniform"):
        broken = fit(simulate(broken_verifier(bug), params, 2, 3, BROKEN_TRIALS, "greedy"), params)
        assert min(broken.values()) < FAIL, (bug, broken)
    broken = fit(simulate_with_accept_stream_reused(monkeypatch, params, 2, 3, BROKEN_TRIALS, "greedy"), params)
    assert min(broken.values()) < FAIL, ("accept_stream_reused", broken)


def random_ks(k: int, seed: int):
    """Each request's k drawn anew at every step from 0 … k (seeded): what an adaptive controller may do."""
    gen = torch.Generator().manual_seed(seed)
    return lambda step, n: torch.randint(0, k + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("mode", ["probabilistic", "greedy"])
def test_varying_k_preserves_the_target_distribution(mode):
    """Any speculation length is lossless: k changing from step to step and request to request,
    k = 0 included, leaves the emitted distribution the target's."""
    params = SamplingParams(temperature=1.0)
    real = fit(simulate(RejectionSampler(), params, 3, 3, TRIALS, mode, k_of=random_ks(3, 5)), params)
    assert min(real.values()) > PASS, real

    def misaligned(target_logits, draft_ids, ks, md, draft_probs, draft_dists):
        # Broken bookkeeping: the right rows, but each request told its neighbour's k.
        return RejectionSampler()(target_logits, draft_ids, ks[1:] + ks[:1], md, draft_probs=draft_probs,
                                  draft_dists=draft_dists)

    broken = fit(simulate(misaligned, params, 3, 3, BROKEN_TRIALS, mode, k_of=random_ks(3, 6)), params)
    assert min(broken.values()) < FAIL, broken


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=1.2, top_k=4, top_p=0.9, min_p=0.3),
], ids=["top_k", "top_p", "all_filters"])
def test_filtered_requests_follow_the_filtered_distribution(params):
    P = target_chain(params)
    assert bool((P == 0).any())  # the filters do cut tokens here
    for mode in ("probabilistic", "greedy"):
        tokens = simulate(RejectionSampler(), params, 2, 3, TRIALS, mode, seed_base=10**6)
        real = fit(tokens, params)
        assert min(real.values()) > PASS, (mode, real)  # off-support tokens would give 0
    raw = simulate(broken_verifier("accept_raw_p"), params, 2, 3, BROKEN_TRIALS, "greedy", seed_base=10**6)
    broken = fit(raw, params)
    assert min(broken.values()) < FAIL, broken
