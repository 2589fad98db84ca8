"""Vocab-parallel verification and drafting (``VocabParallelRejectionSampler``,
``draft_sampling.sample_draft_shard``) on TP 1, 2 and 4 gloo ranks:

* token for token what ``RejectionSampler`` / ``sample_draft_full`` give on the gathered rows, for
  mixed batches (greedy and random requests, top-k / top-p / min-p, probabilistic q, greedy
  drafts, one-hot q rows, k = 0), and q's shards are the gathered q's columns bit for bit;
* bytes per row as documented, none of them O(vocab);
* sampled output follows the target distribution (plain sampling, speculative with greedy and
  with probabilistic drafts, filtered requests), with the vocabulary split over the ranks, while
  deliberately broken variants (residual without the max, a wrong q, a reused noise stream, noise
  keyed by the shard's column instead of the token) fail the same statistical tests.
"""

from __future__ import annotations

import math

import pytest
import torch

import tpspec.spec_decode.vocab_parallel_rejection as vpr
from tests.distributed_utils import run_distributed
from tests.spec_decode.test_rejection_sampler import (
    BROKEN_TRIALS, FAIL, PASS, TRIALS, V, chi2_p_value, fit, mixed_params, request_rows, simulate,
)
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.partition import pad_vocab
from tpspec.sample import vocab_parallel as vp
from tpspec.sample.gumbel import ACCEPT, SAMPLE, gumbel, uniform
from tpspec.sample.sampler import SamplingMetadata
from tpspec.sample.vocab_parallel import LogitsShard, shard_columns
from tpspec.sampling_params import SamplingParams
from tpspec.spec_decode.draft_sampling import sample_draft_full, sample_draft_shard
from tpspec.spec_decode.rejection_sampler import RejectionSampler
from tpspec.spec_decode.vocab_parallel_rejection import VocabParallelRejectionSampler


def _layout(vocab: int, padded: bool = True) -> tuple[int, int]:
    """(vocab_start, shard_size) of this rank: the engine's padded split, or an even split of the
    real tokens (a tiny vocabulary then still spreads over every rank)."""
    tp = get_tp_size()
    size = pad_vocab(vocab, tp) // tp if padded else -(-vocab // tp)
    return get_tp_rank() * size, size


def _shard(full: torch.Tensor, padded: bool = True) -> LogitsShard:
    start, size = _layout(full.shape[-1], padded)
    return LogitsShard(shard_columns(full, start, size, -math.inf), start, full.shape[-1])


# ---- equality with the gathered path ----------------------------------------------------------------


def _verify_cases() -> list[dict]:
    """On every rank: the vocab-parallel verifier and drafter against the gathered ones."""
    out = [dict(zip(("same", "stats"), _draft_bytes_without_filters()))]
    for seed, vocab in ((0, 1000), (1, 65), (2, 3000)):
        g = torch.Generator().manual_seed(seed)
        n = 60
        ks = [i % 5 for i in range(n)]
        rows = sum(ks) + n
        logits = torch.randn(rows, vocab, generator=g) * 2
        params = mixed_params(n)
        md = request_rows(ks, params, [11 * i + seed for i in range(n)], [20 + i for i in range(n)])
        # Probabilistic drafts drawn from q (DRAFT stream), made likely under the target so that
        # both acceptances and rejections occur; every fifth request's q a one-hot (greedy draft).
        q_logits = logits[[r for i, k in enumerate(ks) for r in range(sum(ks[:i]) + i, sum(ks[:i]) + i + k)]]
        q_logits = q_logits + torch.randn(q_logits.shape, generator=g)
        draft_md = SamplingMetadata.from_params(
            [p for p, k in zip(params, ks) for _ in range(k)],
            [11 * i + seed for i, k in enumerate(ks) for _ in range(k)],
            [20 + i + j for i, k in enumerate(ks) for j in range(k)],
        )
        drafts, q = sample_draft_full(q_logits, draft_md)
        shard = _shard(logits)
        start, size = shard.vocab_start, shard.shard_size
        res = dict(case=(seed, vocab))
        comm.reset_comm_stats()
        got_drafts, got_q = sample_draft_shard(_shard(q_logits), draft_md, "draft.sample")
        res["draft_tokens"] = torch.equal(got_drafts, drafts)
        res["draft_q"] = torch.equal(got_q, shard_columns(q, start, size, 0.0))
        res["draft_stats"] = comm.get_comm_stats()
        for name, q_full in (("probabilistic", q), ("greedy_drafts", None)):
            ref = RejectionSampler()(logits, drafts, ks, md,
                                     None if q_full is None else q_full.gather(1, drafts[:, None])[:, 0], q_full)
            comm.reset_comm_stats()
            got = VocabParallelRejectionSampler()(
                shard, drafts, ks, md, "verify.sample", None if q_full is None else shard_columns(q_full, start, size, 0.0))
            res[name] = (got.output_token_ids == ref.output_token_ids, got.num_accepted == ref.num_accepted)
            res[name + "_stats"] = comm.get_comm_stats()
            res[name + "_accepted"] = (sum(ref.num_accepted), sum(ks))
        # Random requests without filters: exact bytes (see the module docstring of
        # vocab_parallel_rejection): per verified draft 12·tp (l(d), q(d), local max) and 8 (Z),
        # one round (two collectives) per position; then 8·tp per request (residual or bonus draw).
        hot = request_rows(ks, [SamplingParams(temperature=1.0)] * n, list(range(n)), [20] * n)
        comm.reset_comm_stats()
        got = VocabParallelRejectionSampler()(shard, drafts, ks, hot, "verify.sample", shard_columns(q, start, size, 0.0))
        res["hot_stats"] = comm.get_comm_stats()
        res["hot_rejections"] = sum(a < k for a, k in zip(got.num_accepted, ks))
        res["hot_verified"] = [min(a + 1, k) for a, k in zip(got.num_accepted, ks)]
        # k = 0 everywhere: plain sampling, 8·tp bytes per row without filters.
        plain = SamplingMetadata.from_params([SamplingParams(temperature=1.0)] * n, list(range(n)), [3] * n)
        comm.reset_comm_stats()
        got = VocabParallelRejectionSampler()(_shard(logits[:n]), torch.zeros(0, dtype=torch.int64), [0] * n,
                                              plain, "verify.sample")
        res["plain"] = got.output_token_ids == RejectionSampler()(
            logits[:n], torch.zeros(0, dtype=torch.int64), [0] * n, plain).output_token_ids
        res["plain_stats"] = comm.get_comm_stats()
        out.append(res)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_verification_and_drafting_equal_the_gathered_path(tp):
    per_rank = [_verify_cases()] if tp == 1 else run_distributed(_verify_cases, tp, timeout=600)
    for rank_res in per_rank:
        draft = rank_res.pop(0)
        assert draft["same"]
        assert draft["stats"] == (
            {} if tp == 1 else {"draft.sample": {"calls": 2, "bytes": 10 * (12 * tp + 8), "cross_node_bytes": 0}})
    for i, ref in enumerate(per_rank[0]):
        for rank_res in per_rank:
            res = rank_res[i]
            assert res["draft_tokens"] and res["draft_q"], res["case"]
            assert res["probabilistic"] == (True, True) and res["greedy_drafts"] == (True, True), res["case"]
            assert res["plain"], res["case"]
        accepted, drafted = ref["probabilistic_accepted"]
        assert 0 < accepted < drafted, ref["case"]  # acceptances and rejections both decided
        if tp == 1:
            continue
        n = 60
        assert ref["plain_stats"] == {"verify.sample": {"calls": 1, "bytes": 8 * tp * n, "cross_node_bytes": 0}}
        assert 0 < ref["hot_rejections"] < n
        verified = ref["hot_verified"]  # drafts verified per request: up to the first rejection
        assert sum(verified) < sum(i % 5 for i in range(n))  # rows after a rejection are never read
        assert ref["hot_stats"] == {"verify.sample": {
            "calls": 2 * max(verified) + 1, "bytes": (12 * tp + 8) * sum(verified) + 8 * tp * n, "cross_node_bytes": 0}}
        # Drafting: filters (candidates [+ top-p's Z + histogram rounds]), then (value, id) and Z.
        assert ref["draft_stats"]["draft.sample"]["calls"] in (4, 8)


def _draft_bytes_without_filters() -> tuple[bool, dict]:
    """Without filters a draft row costs one all-gather of (value, id, local max) and one
    all-reduce of Z: 12·tp + 8 bytes (greedy rows too)."""
    n, vocab = 10, 1000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.8)] * (n - 2) + [SamplingParams(temperature=0)] * 2,
                                      list(range(n)), [5] * n)
    comm.reset_comm_stats()
    tokens, q = sample_draft_shard(_shard(logits), md, "draft.sample")
    ref_tokens, ref_q = sample_draft_full(logits, md)
    start, size = _layout(vocab)
    same = torch.equal(tokens, ref_tokens) and torch.equal(q, shard_columns(ref_q, start, size, 0.0))
    return same, comm.get_comm_stats()


# ---- sampling losslessness, with the vocabulary split over the ranks --------------------------------


def _vp_verifier(q_override=None):
    """``simulate``'s verify() on this rank's columns (an even split of the V = 6 tokens)."""
    def verify(target, draft_ids, ks, md, draft_probs, draft_dists):
        start, size = _layout(V, padded=False)
        q = draft_dists if q_override is None or draft_dists is None else q_override(draft_dists)
        return VocabParallelRejectionSampler()(
            _shard(target, padded=False), draft_ids, ks, md, "verify.sample",
            None if q is None else shard_columns(q, start, size, 0.0),
        )
    return verify


LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
DRAWS = 20000


def _plain_draws(params: SamplingParams, keyed_by_column: bool = False) -> torch.Tensor:
    """DRAWS vocab-parallel samples of LOGITS8 (position = counter), split evenly over the ranks.
    ``keyed_by_column`` (broken): the noise keyed by the shard's column, not the global token id."""
    md = SamplingMetadata.from_params([params] * DRAWS, [1] * DRAWS, list(range(DRAWS)))
    shard = _shard(LOGITS8.expand(DRAWS, -1), padded=False)
    if not keyed_by_column:
        return vp.sample(shard, md, "sample")
    noise = gumbel(md.seeds, md.positions, torch.arange(shard.shard_size), SAMPLE)
    proc, _ = vp.processed(shard, md, "sample")
    return vp.argmax(shard.replace(noise + proc.logits), "sample")


def _statistics() -> dict[str, float]:
    """On every rank: min p-value of each real run and each broken control (module attributes are
    patched in this process only, around the broken runs)."""
    res = {}
    hot = SamplingParams(temperature=1.0)
    res["probabilistic"] = min(fit(simulate(_vp_verifier(), hot, 2, 3, TRIALS), hot).values())
    cold = SamplingParams(temperature=0.8)
    res["greedy_drafts"] = min(fit(simulate(_vp_verifier(), cold, 2, 3, TRIALS, "greedy"), cold).values())
    filtered = SamplingParams(temperature=1.2, top_k=4, top_p=0.9, min_p=0.3)
    for mode in ("probabilistic", "greedy"):
        tokens = simulate(_vp_verifier(), filtered, 2, 3, TRIALS, mode, seed_base=10**6)
        res[f"filtered_{mode}"] = min(fit(tokens, filtered).values())
    plain = SamplingParams(temperature=0.7, top_p=0.95)
    target = torch.softmax(LOGITS8 / 0.7, -1)
    keep = torch.softmax(LOGITS8 / 0.7, -1).sort(descending=True)
    cut = int((keep.values.cumsum(0) < 0.95).sum()) + 1
    nucleus = torch.zeros(8)
    nucleus[keep.indices[:cut]] = target[keep.indices[:cut]]
    res["plain"] = chi2_p_value(_plain_draws(plain), nucleus / nucleus.sum())

    # Broken controls.
    def patched(name, value, fn):
        saved = getattr(vpr, name)
        setattr(vpr, name, value)
        try:
            return fn()
        finally:
            setattr(vpr, name, saved)

    broken = {}
    broken["residual_without_max"] = patched(
        "residual_log", lambda p, q: (p - q).abs().log(),
        lambda: simulate(_vp_verifier(), hot, 2, 3, BROKEN_TRIALS))
    broken["wrong_q"] = simulate(_vp_verifier(lambda q: torch.full_like(q, 1.0 / V)), hot, 2, 3, BROKEN_TRIALS)
    # The accept test's uniform keyed by a fixed token and reused as the residual's noise (as in
    # test_rejection_sampler: a rejection means a large u, hence large noise for token 0).
    broken["residual_reuses_accept_noise"] = patched(
        "uniform", lambda s, p, ids, stream: uniform(s, p, torch.zeros_like(ids), stream),
        lambda: patched("RESIDUAL", ACCEPT, lambda: simulate(_vp_verifier(), cold, 2, 3, BROKEN_TRIALS, "greedy")))
    for name, tokens in broken.items():
        res["broken_" + name] = min(fit(tokens, cold if name == "residual_reuses_accept_noise" else hot).values())
    res["broken_plain_noise_by_column"] = chi2_p_value(_plain_draws(plain, keyed_by_column=True), nucleus / nucleus.sum())
    return res


def test_vocab_parallel_sampling_preserves_the_target_distribution():
    """At TP 2, 3 of the 6 (8 for plain sampling: 4) tokens on each rank."""
    results = run_distributed(_statistics, 2, timeout=600)
    assert results[0] == results[1]  # every rank drew the same tokens
    res = results[0]
    for name, p in res.items():
        if name.startswith("broken_"):
            assert p < FAIL, (name, p)
        else:
            assert p > PASS, (name, p)
