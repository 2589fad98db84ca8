"""``sample.vocab_parallel`` on TP 1, 2 and 4 gloo ranks equals the same computation on the
gathered row (``sample.sampler``): argmax and Gumbel-max token for token (ties to the lowest id),
top-k / top-p / min-p masks bit for bit (ties at the k-th value and at the nucleus boundary,
flat rows whose nucleus the candidates cannot settle, vocab padding, a shard of padding only),
plain sampling (greedy, temperature, filters) token for token; logsumexp and logprobs up to float
rounding (top-n ids exactly). Bytes per row are as documented, and broken variants (top-k from
the local shard only, top-p trusting candidates without the completeness bound, ties to the
highest rank) disagree on the same cases, so the checks have teeth.

Also ``sample.mass``: exact integer normalizers, and their precision against softmax."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed_utils import run_distributed
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.partition import pad_vocab
from tpspec.sample import vocab_parallel as vp
from tpspec.sample.gumbel import SAMPLE, gumbel
from tpspec.sample.mass import MASS_BITS, masses, probs, reached
from tpspec.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k,
    apply_top_k_top_p_min_p,
    logprobs_of,
    top_p_threshold,
)
from tpspec.sample.vocab_parallel import LogitsShard, shard_columns
from tpspec.sampling_params import SamplingParams

VOCABS = [1000, 65, 4096]  # padded 1024 (64 at TP 1, 2, 4); 65: at TP 4 the last shard is all padding
KINDS = ["randn", "ties", "flat", "peaky", "skewed"]
ROWS = 24
PARAMS = [  # temperature, top_k, top_p, min_p: one per row, cycling
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.5, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0),
    (0.9, 0, 1.0, 0.1), (0.5, 50, 0.95, 0.05), (1.3, 100, 0.999, 0.0), (2.0, 1, 1.0, 0.0), (1.0, 0, 0.999, 0.0),
    (0.0, 3, 0.8, 0.0), (1.0, 20, 0.7, 0.3), (1.0, 0, 0.18, 0.0),
]


def _logits(vocab: int, kind: str, seed: int) -> torch.Tensor:
    """Full logits [ROWS, vocab] (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(ROWS, vocab, generator=g) * 2
    if kind == "ties":  # integer logits: ties everywhere, at the k-th value and the nucleus boundary
        return torch.randint(-3, 4, (ROWS, vocab), generator=g).float()
    if kind == "flat":  # nucleus of most of the vocab: top-p beyond the candidates
        return torch.randn(ROWS, vocab, generator=g) * 0.05
    if kind == "skewed":  # the first half's shards hold most of the mass: at TP 2 the candidates can
        # reach top_p·Z at a value below the other shard's c-th candidate (then they are incomplete)
        x = torch.randn(ROWS, vocab, generator=g) * 0.01
        x[:, : vocab // 2] += 1.0
        return x
    x = torch.randn(ROWS, vocab, generator=g) * 0.5
    x[torch.arange(ROWS), torch.randint(0, vocab, (ROWS,), generator=g)] += 12.0  # one dominant token
    return x


def _metadata(seed: int) -> SamplingMetadata:
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in
              (PARAMS[(i + seed) % len(PARAMS)] for i in range(ROWS))]
    return SamplingMetadata.from_params(params, [seed * 100 + i for i in range(ROWS)], [7 * i for i in range(ROWS)])


def _my_shard(full: torch.Tensor, fill: float = -math.inf) -> LogitsShard:
    vocab, tp = full.shape[-1], get_tp_size()
    size = pad_vocab(vocab, tp) // tp
    start = get_tp_rank() * size
    return LogitsShard(shard_columns(full, start, size, fill), start, vocab)


def _same_columns(shard: LogitsShard, full: torch.Tensor) -> bool:
    return torch.equal(shard.logits, shard_columns(full, shard.vocab_start, shard.shard_size, -math.inf))


def _broken_top_k_local(shard: LogitsShard, top_k: torch.Tensor) -> torch.Tensor:
    """Broken: each shard applies top-k to its own columns (no exchange)."""
    return apply_top_k(shard.logits, top_k.clamp(max=shard.shard_size))


def _broken_top_p_trusting_candidates(shard: LogitsShard, top_p: torch.Tensor) -> torch.Tensor:
    """Broken: top-p threshold from the gathered candidates alone, whether or not they cover it."""
    c = vp.TOP_P_CANDIDATES
    pool = comm.all_gather(vp._local_top(shard.logits, c), "broken", dim=0).view(-1, shard.logits.shape[0], c)
    pool = pool.permute(1, 0, 2).reshape(shard.logits.shape[0], -1)
    row_max = pool.amax(-1)
    total = comm.all_reduce(masses(shard.logits, row_max).sum(-1), "broken")
    thr, _ = top_p_threshold(pool.sort(-1, descending=True).values, row_max, total, top_p)
    out = shard.logits.masked_fill(shard.logits < thr, -math.inf)
    return torch.where((top_p < 1).unsqueeze(-1), out, shard.logits)


def _check_cases(cases: list[tuple]) -> list[dict]:
    """On every rank: each primitive on the shard against the gathered reference; plain values only."""
    out = []
    for vocab, kind, seed in cases:
        full = _logits(vocab, kind, seed)
        md = _metadata(seed)
        shard = _my_shard(full)
        scaled_full = full / md.temperature.clamp(min=0.1).unsqueeze(-1)
        scaled = _my_shard(scaled_full)
        res = dict(case=(vocab, kind, seed))
        comm.reset_comm_stats()
        res["argmax"] = vp.argmax(shard, "t.argmax").tolist() == full.argmax(-1).tolist()
        noise = gumbel(md.seeds, md.positions, torch.arange(vocab), SAMPLE)
        res["gumbel_max"] = vp.gumbel_max(shard, md.seeds, md.positions, SAMPLE, "t.gumbel").tolist() == \
            (full + noise).argmax(-1).tolist()
        lse = vp.logsumexp(shard, "t.lse")
        res["lse_err"] = float((lse - torch.logsumexp(full, -1)).abs().max())
        tokens = torch.randint(0, vocab, (ROWS, 3), generator=torch.Generator().manual_seed(seed))
        lp = vp.token_logprobs(shard, tokens, "t.token_lp")
        res["token_lp_err"] = float((lp - torch.log_softmax(full, -1).gather(1, tokens)).abs().max())
        got, want = vp.logprobs_of(shard, tokens[:, 0], 5, "t.lp"), logprobs_of(full, tokens[:, 0], 5)
        res["top_ids"] = torch.equal(got.topk_token_ids, want.topk_token_ids)
        res["lp_err"] = max(float((got.topk_logprobs - want.topk_logprobs).abs().max()),
                            float((got.token_logprob - want.token_logprob).abs().max()))
        filtered, row_max = vp.apply_top_k_top_p_min_p(scaled, md.top_k, md.top_p, md.min_p, "t.filters")
        reference = apply_top_k_top_p_min_p(scaled_full, md.top_k, md.top_p, md.min_p)
        res["filters"] = _same_columns(filtered, reference)
        res["row_max"] = row_max is None or torch.equal(row_max, reference.amax(-1))
        res["sample"] = vp.sample(shard, md, "t.sample").tolist() == Sampler()(full, md).sampled_token_ids.tolist()
        res["stats"] = comm.get_comm_stats()
        # Broken variants, on the same inputs.
        k_rows = md.top_k > 0
        res["broken_top_k"] = not torch.equal(
            _broken_top_k_local(scaled, md.top_k)[k_rows],
            _my_shard(apply_top_k(scaled_full, md.top_k)).logits[k_rows],
        )
        res["broken_top_p"] = not _same_columns(
            scaled.replace(_broken_top_p_trusting_candidates(scaled, md.top_p)),
            apply_top_k_top_p_min_p(scaled_full, torch.zeros_like(md.top_k), md.top_p, torch.zeros_like(md.min_p)),
        )
        g_values, g_ids = vp.local_best(shard.logits, shard.vocab_start)
        g = vp.gather_columns([g_values, g_ids.float()], "broken")
        highest_rank = g[..., 0].flip(0).argmax(0, keepdim=True)
        res["broken_ties"] = g[..., 1].flip(0).gather(0, highest_rank).squeeze(0).long().tolist() != \
            full.argmax(-1).tolist()
        out.append(res)
    return out


def _cases() -> list[tuple]:
    return [(vocab, kind, 10 * i + j) for i, vocab in enumerate(VOCABS) for j, kind in enumerate(KINDS)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_primitives_equal_the_gathered_ones(tp):
    cases = _cases()
    per_rank = [_check_cases(cases)] if tp == 1 else run_distributed(_check_cases, tp, cases, timeout=600)
    n_broken_top_k = n_broken_top_p = n_broken_ties = 0
    for i, case in enumerate(cases):
        ref = per_rank[0][i]
        for rank_res in per_rank:  # every rank decides the same (each compares its own columns)
            res = rank_res[i]
            for key in ("argmax", "gumbel_max", "filters", "row_max", "sample", "top_ids"):
                assert res[key], (case, key)
            assert res["lse_err"] < 2e-5 and res["token_lp_err"] < 2e-5 and res["lp_err"] < 2e-5, (case, res)
        stats = ref["stats"]
        if tp == 1:
            assert stats == {}
        else:
            assert stats["t.argmax"] == {"calls": 1, "bytes": 8 * tp * ROWS, "cross_node_bytes": 0}
            assert stats["t.gumbel"] == {"calls": 1, "bytes": 8 * tp * ROWS, "cross_node_bytes": 0}
            assert stats["t.lse"] == {"calls": 1, "bytes": 8 * tp * ROWS, "cross_node_bytes": 0}
            assert stats["t.token_lp"] == {"calls": 1, "bytes": (2 + 3) * 4 * tp * ROWS, "cross_node_bytes": 0}
            lp_bytes = (3 + 2 * min(5, pad_vocab(case[0], tp) // tp)) * 4 * tp * ROWS
            assert stats["t.lp"] == {"calls": 1, "bytes": lp_bytes, "cross_node_bytes": 0}
            # Candidates (1 all-gather), top-p's Z (1 all-reduce), and for flat rows the 4 rounds of
            # the histogram search; never the vocabulary.
            calls = stats["t.filters"]["calls"]
            assert calls in (2, 6), (case, calls)
            if case[1] in ("flat", "skewed") and case[0] > 100 * tp:
                assert calls == 6, case  # the fallback really ran
        n_broken_top_k += ref["broken_top_k"]
        n_broken_top_p += ref["broken_top_p"]
        n_broken_ties += ref["broken_ties"]
    if tp > 1:  # the checks have teeth
        assert n_broken_top_k >= 6 and n_broken_top_p >= 2 and n_broken_ties >= 2, (n_broken_top_k, n_broken_top_p, n_broken_ties)


def test_unfiltered_rows_exchange_nothing_and_zero_rows():
    shard = LogitsShard(torch.randn(3, 64), 0, 64)
    zero, one = torch.zeros(3, dtype=torch.int64), torch.ones(3)
    out, row_max = vp.apply_top_k_top_p_min_p(shard, zero, one, torch.zeros(3), "x")
    assert out is shard and row_max is None
    empty = LogitsShard(torch.zeros(0, 64), 0, 64)
    assert vp.argmax(empty, "x").shape == (0,)
    md = SamplingMetadata.from_params([], [], [])
    assert vp.sample(empty, md, "x").shape == (0,)


# ---- sample.mass -----------------------------------------------------------------------------------


def test_masses_are_exact_and_order_independent():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3000, generator=g) * 3
    x[0, :100] = -math.inf
    row_max = x.amax(-1)
    m = masses(x, row_max)
    assert m.dtype == torch.int64 and bool((m[0, :100] == 0).all())
    assert bool((m.amax(-1) == 2**MASS_BITS).all())  # the maximum weighs exactly 2^38
    perm = torch.randperm(3000, generator=g)
    assert torch.equal(masses(x[:, perm], row_max).sum(-1), m.sum(-1))  # integer sums: any order
    parts = sum(masses(x[:, a:b], row_max).sum(-1) for a, b in ((0, 7), (7, 1500), (1500, 3000)))
    assert torch.equal(parts, m.sum(-1))
    p = probs(x, row_max, m.sum(-1))
    assert torch.allclose(p, torch.softmax(x, -1), rtol=1e-5, atol=1e-9)
    assert abs(float(p.double().sum(-1).max()) - 1) < 1e-5


def test_reached_compares_with_top_p_times_total():
    total = torch.tensor([1000, 2**62])
    cum = torch.tensor([[899, 900], [2**61 - 2**20, 2**61]])
    assert reached(cum, torch.tensor([0.9, 0.5]), total).tolist() == [[False, True], [False, True]]
