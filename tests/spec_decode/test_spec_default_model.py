"""The default model (SmolLM2-135M, vocab 49152) as its own draft at TP 2 with
use_local_argmax_reduction: greedy output equals plain greedy output and every draft is accepted,
while drafting moves 8·tp bytes per draft row instead of the 4·49152 a full-logits gather would."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.models.loader.resolve import resolve_model

PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea."]
MAX_TOKENS = 24
K = 7  # 1 + 8 + 8 + 7: the last round's drafts are cut by max_tokens
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def runs() -> dict:
    model = resolve_model(None)  # the cached GGUF conversion
    out = {}
    with LLM(model, **ENGINE) as llm:
        out["plain"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": K, "use_local_argmax_reduction": True,
            "adaptive": False}
    with LLM(model, speculative_config=spec, **ENGINE) as llm:
        out["spec"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        out["stats"] = llm.get_stats()
        out["vocab"] = llm.llm_engine.config.arch.vocab_size
    return out


def test_self_draft_is_lossless_and_fully_accepted(runs):
    assert all(len(t) == MAX_TOKENS for t in runs["plain"])
    assert runs["spec"] == runs["plain"]
    s = runs["stats"]
    assert s["num_draft_tokens"] > 0
    assert s["num_accepted_tokens"] == s["num_draft_tokens"]
    assert s["num_accepted_tokens_per_pos"][0] == s["num_drafts"]
    # 2 requests x (1 prefill token + rounds of K + 1): 24 = 1 + 8 + 8 + 7 -> 3 rounds each.
    assert s["num_drafts"] == 2 * 3
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_flag_moves_8_tp_bytes_per_draft_row(runs):
    site = runs["stats"]["comm"]["draft.sample"]
    # Both requests advance in lockstep (same prompt step, every draft accepted), so every call
    # drafts one row per request and gathers a [2, 2] float32 (value, id) tensor from each of the
    # 2 ranks: 8 * tp bytes per row. A full-logits gather would be 4 * 49152 per row.
    assert runs["vocab"] == 49152
    assert site["calls"] >= K
    assert site["bytes"] == site["calls"] * 2 * (8 * 2)
