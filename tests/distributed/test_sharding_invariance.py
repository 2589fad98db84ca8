"""Sharding invariance end to end through ``LLM``: with ``sampling_mode="vocab-parallel"`` a seeded
request yields the same tokens at TP 1, 2 and 4, greedy and sampled (temperature, top-k, top-p,
min-p), plain and speculative (ngram, draft model with greedy drafts and with probabilistic
drafts under ``use_local_argmax_reduction``), and the same tokens as the gathered path (logprobs:
the same top ids, values up to float rounding, the KV cache's float16 included). Draft noise, acceptance and residual draws are
keyed by (seed, position, global token id), never by rank or shard layout."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpspec import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # a repeated pattern: ngram proposes at once
    "Tensor parallelism splits the vocabulary across ranks, and",
]
TOKENS = 16
PARAMS = [
    SamplingParams(temperature=1.5, seed=11, top_p=0.9, max_tokens=TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=12, top_k=20, min_p=0.02, max_tokens=TOKENS, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.8, seed=14, max_tokens=TOKENS, ignore_eos=True),
]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def perturbed(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama with 2% noise on every matrix: a draft that is often, not always, right."""
    dst = str(tmp_path_factory.mktemp("invariance") / "perturbed")
    shutil.copytree(tiny_llama, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    noisy = {k: (w + 0.02 * w.std() * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w).contiguous()
             for k, w in weights.items()}
    save_file(noisy, os.path.join(dst, "model.safetensors"))
    return dst


def _spec(method: str, draft: str) -> dict | None:
    if method == "plain":
        return None
    # k pinned: an adaptive k follows timings, which differ between TP sizes, and seeded outputs
    # depend on which drafts were verified.
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)
    spec = dict(method="draft_model", model=draft, num_speculative_tokens=3, use_local_argmax_reduction=True, adaptive=False,
                draft_sample_method="greedy" if method == "draft-greedy" else "probabilistic")
    if method == "draft-probabilistic-replicated":  # q over the whole vocabulary on every rank
        spec["draft_tensor_parallel_size"] = 1
    return spec


_RUNS: dict = {}


def _run(target: str, draft: str, method: str, tp: int, mode: str) -> dict:
    key = (method, tp, mode)
    if key not in _RUNS:
        with LLM(target, tensor_parallel_size=tp, sampling_mode=mode, speculative_config=_spec(method, draft),
                 **ENGINE) as llm:
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            _RUNS[key] = dict(
                tokens=[o.outputs[0].token_ids for o in outs],
                logprobs=[o.outputs[0].logprobs for o in outs],
                stats=llm.get_stats(),
            )
    return _RUNS[key]


VP = "vocab-parallel"
CASES = [  # (method, the runs that must equal the gathered TP 1 run)
    ("plain", [(1, VP), (2, VP), (4, VP)]),
    ("ngram", [(1, VP), (2, VP)]),
    ("draft-greedy", [(1, VP), (2, VP)]),
    # Gathered at TP 2: the sharded q is all-gathered for the gathered verifier.
    ("draft-probabilistic", [(1, VP), (2, VP), (4, VP), (2, "gathered")]),
    ("draft-probabilistic-replicated", [(2, VP)]),
]


@pytest.mark.parametrize("method,runs", CASES, ids=[c[0] for c in CASES])
def test_vocab_parallel_tokens_are_the_same_at_every_tp_size_and_equal_the_gathered_path(
    method, runs, tiny_llama, perturbed
):
    ref = _run(tiny_llama, perturbed, method.removesuffix("-replicated"), 1, "gathered")
    assert all(len(t) == TOKENS for t in ref["tokens"])
    for tp, mode in runs:
        got = _run(tiny_llama, perturbed, method, tp, mode)
        assert got["tokens"] == ref["tokens"], (method, tp)
        for mine, theirs in zip(got["logprobs"], ref["logprobs"]):
            assert (mine is None) == (theirs is None)
            for a, b in zip(mine or [], theirs or []):
                assert list(a) == list(b)  # the same tokens, in the same order
                # Up to rounding: TP sizes sum a product's shards in different orders, and the float16
                # KV cache can round two keys a last bit apart to neighbouring float16 values (1.4e-4 seen).
                assert all(abs(a[t] - b[t]) < 1e-3 for t in a), max(abs(a[t] - b[t]) for t in a)
        stats = got["stats"]
        sites = {"plain": ["sample"], "ngram": ["verify.sample"]}.get(method, ["draft.sample", "verify.sample"])
        assert sorted(stats["comm_bytes_per_row"]) == sorted(sites)
        if method.endswith("replicated"):  # the replicated draft samples without communication
            assert stats["comm_bytes_per_row"]["draft.sample"] == 0
            assert stats["comm_bytes_per_row"]["verify.sample"] > 0
        else:
            assert all((v > 0) == (tp > 1) for v in stats["comm_bytes_per_row"].values())
        assert "logits.all_gather" not in stats["comm"]
        if method.startswith("draft"):
            assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections happened
        elif method == "ngram":
            assert stats["num_draft_tokens"] > 0


def test_sampling_mode_is_validated_and_reaches_the_engine(tiny_llama):
    from tpspec.cli import build_parser, engine_kwargs
    from tpspec.config import EngineConfig, ModelArchConfig, SchedulerConfig

    arch = ModelArchConfig.from_folder(tiny_llama)
    sched = SchedulerConfig(max_model_len=128)
    with pytest.raises(ValueError, match=r"sampling_mode must be one of \('gathered', 'vocab-parallel'\), got 'sharded'"):
        EngineConfig(model=tiny_llama, arch=arch, scheduler=sched, sampling_mode="sharded")
    with pytest.raises(ValueError, match="sampling_mode"):
        LLM(tiny_llama, sampling_mode="sharded")  # before any model is loaded
    huge = ModelArchConfig(**{**arch.__dict__, "vocab_size": 2**24})
    with pytest.raises(ValueError, match=r"sampling_mode='vocab-parallel' needs vocab_size < 2\*\*24"):
        EngineConfig(model=tiny_llama, arch=huge, scheduler=sched, sampling_mode="vocab-parallel")
    assert EngineConfig(model=tiny_llama, arch=arch, scheduler=sched).sampling_mode == "gathered"
    args = build_parser().parse_args(["generate", "--sampling-mode", "vocab-parallel"])
    assert engine_kwargs(args)["sampling_mode"] == "vocab-parallel"
    assert engine_kwargs(build_parser().parse_args(["generate"]))["sampling_mode"] == "gathered"
