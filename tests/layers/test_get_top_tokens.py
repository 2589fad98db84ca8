"""``get_top_tokens`` (local argmax + one (value, id) all-gather) equals
``compute_logits(h).argmax(-1)`` exactly at TP 1, 2 and 4: tie-heavy integer weights (ties inside a
shard, across shards, and created by soft-cap saturation), vocabularies with padding on the last
shard(s) (32001, 1000, 65: a shard that is all padding at TP 4) and without (1024, 49152),
float32/bfloat16/float16, scale and soft-cap set, 1 to 256 rows, NaN logits. It gathers exactly
8·tp bytes per row against compute_logits' 4·padded_vocab. Broken variants (ties to the highest id,
padding left unmasked) are shown to disagree on the same cases, so the checks have teeth."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_size
from tpspec.layers.logits import MAX_LOCAL_ARGMAX_VOCAB, LogitsProcessor, check_local_argmax_vocab
from tpspec.layers.partition import pad_vocab
from tpspec.layers.vocab_parallel import ParallelLMHead

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VOCABS = [32001, 1000, 65, 1024, 49152]
KINDS = ["ties", "dup", "negative", "randn"]
ROWS = [1, 37, 256]  # 3 against 4 transforms: every pairing occurs
# (scale, soft_cap); soft_cap 1.0 saturates tanh on integer logits: new ties the raw logits lack.
TRANSFORMS = [(1.0, None), (0.5, 1.0), (2.5, 30.0), (1.0, 4.0)]


def _cases() -> list[tuple]:
    cases, i = [], 0
    for vocab in VOCABS:
        for dtype in DTYPES:
            for kind in KINDS + (["nan"] if dtype != "float16" else []):
                scale, cap = TRANSFORMS[i % len(TRANSFORMS)]
                cases.append((vocab, ROWS[i % len(ROWS)], dtype, kind, scale, cap, i))
                i += 1
    return cases


def _planted_ids(vocab: int, padded: int, tp: int) -> list[int]:
    """Ids of identical winning rows: each later shard's first id (when real), and the last id."""
    shard = padded // tp
    ids = [r * shard for r in range(1, tp) if r * shard < vocab] if tp > 1 else [vocab // 2]
    ids = sorted(set(ids + [vocab - 1]))
    return ids if len(ids) > 1 else [vocab - 2, vocab - 1]


def _make(vocab: int, rows: int, kind: str, seed: int, tp: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Full weight [vocab, hidden] and hidden [rows, hidden] (float32, same on every rank), and the
    token every row must pick when the case forces one."""
    g = torch.Generator().manual_seed(seed)
    hsize = 16
    forced = None
    if kind == "randn":
        w = torch.randn(vocab, hsize, generator=g) * 0.5
        h = torch.randn(rows, hsize, generator=g)
        return w, h, None
    w = torch.randint(-1, 2, (vocab, hsize), generator=g).float()
    h = torch.randint(-1, 2, (rows, hsize), generator=g).float()
    if kind == "dup":  # identical, strictly best rows in several shards: the lowest id must win
        ids = _planted_ids(vocab, pad_vocab(vocab, tp), tp)
        w[ids] = 2.0
        h = torch.randint(0, 2, (rows, hsize), generator=g).float()
        h[:, 0] = 1.0  # sum(h) > 0: planted logit 2·sum(h) beats every other (≤ sum(h))
        forced = ids[0]
    elif kind == "negative":  # every real logit < 0, so a zero padding column would win if unmasked
        # (hidden size 4: only 16 distinct weight rows, so the best one repeats: ties)
        w = torch.randint(1, 3, (vocab, 4), generator=g).float()
        h = -torch.randint(1, 3, (rows, 4), generator=g).float()
    elif kind == "nan":  # NaN columns in later shards: argmax ranks NaN highest, first NaN wins
        ids = _planted_ids(vocab, pad_vocab(vocab, tp), tp)
        w[ids] = float("nan")
        forced = ids[0]
    return w, h, forced


def _check_cases(cases: list[tuple]) -> list[dict]:
    """On every rank: run each case through compute_logits + argmax, get_top_tokens and two broken
    variants; return the ids and the gathered bytes of each."""
    tp, out = get_tp_size(), []
    for vocab, rows, dtype_name, kind, scale, cap, seed in cases:
        dtype = DTYPES[dtype_name]
        w, h, forced = _make(vocab, rows, kind, seed, tp)
        head = ParallelLMHead(vocab, w.shape[1], dtype)
        head.weight_loader(head.weight, w.to(dtype))
        h = h.to(dtype)
        proc = LogitsProcessor(vocab, scale=scale, soft_cap=cap)
        comm.reset_comm_stats()
        logits = proc.compute_logits(head, h, site="test.full")  # [rows, vocab]
        full = logits.argmax(-1)
        top = proc.get_top_tokens(head, h, site="test.top")
        # Broken: padding left unmasked (the same code, told the padded vocab is real).
        nomask = None
        if kind == "negative":
            nomask = LogitsProcessor(head.padded_vocab_size, scale=scale, soft_cap=cap).get_top_tokens(head, h, site="test.nomask")
        # Broken: ties to the highest id.
        highest = vocab - 1 - logits.flip(-1).argmax(-1)
        # Plain lists: tensors sent through the result queue would outlive their sender's memory.
        out.append(dict(case=(vocab, rows, dtype_name, kind, scale, cap), padded=head.padded_vocab_size,
                        full=full.tolist(), top=top.tolist(), nomask=None if nomask is None else nomask.tolist(), highest=highest.tolist(),
                        forced=forced, stats=comm.get_comm_stats(), top_dtype=top.dtype, top_shape=tuple(top.shape)))
    return out


def _run(tp: int, cases: list[tuple]) -> list[list[dict]]:
    if tp == 1:
        return [_check_cases(cases)]
    return run_distributed(_check_cases, tp, cases, timeout=600)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_get_top_tokens_equals_full_argmax(tp):
    cases = _cases()
    per_rank = _run(tp, cases)
    assert len(per_rank) == tp
    n_highest_differs = n_nomask_differs = 0
    for i in range(len(cases)):
        ref = per_rank[0][i]
        name = ref["case"]
        vocab, rows, _, kind, _, _ = name
        for rank_results in per_rank:  # every rank decides the same tokens
            res = rank_results[i]
            assert res["top"] == ref["top"] and res["full"] == ref["full"], name
        assert ref["top_dtype"] == torch.int64 and ref["top_shape"] == (rows,), name
        assert ref["top"] == ref["full"], (name, ref["top"], ref["full"])
        assert max(ref["top"]) < vocab, name
        # (Except "dup" under soft-cap 1.0: tanh saturates both to 1.0 and the tie goes lower.)
        if ref["forced"] is not None and not (kind == "dup" and name[5] == 1.0):
            assert ref["top"] == [ref["forced"]] * rows, name
        if kind in ("dup", "ties", "negative") and rows > 1:
            assert ref["highest"] != ref["full"], name  # ties decide this case
            n_highest_differs += 1
        if kind == "negative" and ref["padded"] > vocab:
            # The padding (zero rows, logit 0 > every real logit) is never chosen; unmasked, it is.
            assert min(ref["nomask"]) >= vocab, name
            n_nomask_differs += 1
        # Bytes gathered per row: 8·tp for get_top_tokens, 4·padded_vocab for compute_logits.
        stats = ref["stats"]
        if tp == 1:
            assert stats == {}, name
        else:
            assert stats["test.top"] == {"calls": 1, "bytes": 8 * tp * rows, "cross_node_bytes": 0}, name
            assert stats["test.full"] == {"calls": 1, "bytes": 4 * ref["padded"] * rows, "cross_node_bytes": 0}, name
    # The cases have teeth: tie resolution and padding masking both decide outcomes.
    assert n_highest_differs >= 30
    assert n_nomask_differs == sum(1 for c in cases if c[3] == "negative" and pad_vocab(c[0], tp) > c[0])
    assert n_nomask_differs > 0


def test_zero_rows():
    head = ParallelLMHead(1000, 8)
    out = LogitsProcessor(1000).get_top_tokens(head, torch.zeros(0, 8))
    assert out.shape == (0,) and out.dtype == torch.int64


def test_refuses_vocab_at_or_above_2_pow_24():
    head = ParallelLMHead(64, 4)  # never reached: the check comes first
    check_local_argmax_vocab(MAX_LOCAL_ARGMAX_VOCAB - 1)
    for vocab in (MAX_LOCAL_ARGMAX_VOCAB, MAX_LOCAL_ARGMAX_VOCAB + 1):
        with pytest.raises(ValueError, match="vocab_size"):
            check_local_argmax_vocab(vocab)
        with pytest.raises(ValueError, match="2\\*\\*24"):
            LogitsProcessor(vocab).get_top_tokens(head, torch.zeros(2, 4))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_refuses_non_positive_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        LogitsProcessor(1000, scale=scale)


def _model_check() -> tuple[list[int], list[int], dict]:
    from tpspec.config import ModelArchConfig
    from tpspec.models.llama import LlamaForCausalLM

    cfg = ModelArchConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = LlamaForCausalLM(cfg, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    emb = torch.randint(-1, 2, (1000, 32), generator=g).to(torch.bfloat16)
    model.embed_tokens.weight_loader(model.embed_tokens.weight, emb)
    h = torch.randint(-1, 2, (64, 32), generator=g).to(torch.bfloat16)
    comm.reset_comm_stats()
    full = model.compute_logits(h).argmax(-1)
    top = model.get_top_tokens(h)
    return full.tolist(), top.tolist(), comm.get_comm_stats()


def test_llama_get_top_tokens_tp2():
    for full, top, stats in run_distributed(_model_check, 2):
        assert full == top
        assert stats["draft.sample"] == {"calls": 1, "bytes": 8 * 2 * 64, "cross_node_bytes": 0}
        assert stats["logits.all_gather"] == {"calls": 1, "bytes": 4 * 1024 * 64, "cross_node_bytes": 0}
