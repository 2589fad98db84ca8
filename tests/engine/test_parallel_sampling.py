"""``n > 1`` through ``LLM``: the prompt is computed once and its blocks are shared by the n
choices (prefix caching), the choices are independent draws, a seeded request gives the same n
choices every time (choice i is what ``n = 1`` gives with seed + i), and nothing stays referenced."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=128)
PROMPT = list(range(10, 60))  # 50 tokens: 6 full blocks before its last token


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        yield llm


def _ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_seeded_choices_are_reproducible_independent_draws(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert _ids(first) == _ids(again)
    assert len({tuple(t) for t in _ids(first)}) == 3  # three different draws
    for i in range(3):
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == first.outputs[i].token_ids
    unseeded = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len({tuple(t) for t in _ids(unseeded[0])}) == 3


def test_the_prompt_is_computed_once_and_its_blocks_shared(llm):
    prompt = list(range(100, 150))  # not seen before
    before = llm.get_stats()
    out = llm.generate([prompt, prompt[:20]], [SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=6),
                                               SamplingParams(n=2, temperature=0, max_tokens=6)], use_tqdm=False)
    after = llm.get_stats()
    # The 3 later choices of the first prompt take its 6 full blocks; the second's later choice its 2.
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 3 * 48 + 16
    assert len(out[0].outputs) == 4 and len(out[1].outputs) == 2
    assert out[1].outputs[0].token_ids == out[1].outputs[1].token_ids  # greedy choices are all alike
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"]  # every reference dropped


def test_the_engine_takes_one_sequence_per_request(llm):
    with pytest.raises(ValueError, match="n=2"):
        llm.llm_engine.add_request(PROMPT, SamplingParams(n=2))


def test_choices_without_the_cache_and_under_speculation(llm, tiny_llama):
    """The same seeded choices without the cache; under speculation (lossless: greedy choices equal
    plain greedy; seeded ones follow the same distribution, with their own draws) the later
    choices take the first one's blocks too, and a seeded request repeats."""
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    want = _ids(llm.generate([PROMPT], params, use_tqdm=False)[0])
    want_greedy = _ids(llm.generate([PROMPT], greedy, use_tqdm=False)[0])
    with LLM(tiny_llama, enable_prefix_caching=False, **ENGINE) as off:
        assert _ids(off.generate([PROMPT], params, use_tqdm=False)[0]) == want
        assert off.get_stats()["prefix_cache_hits"] == 0
    spec = dict(method="draft_model", model=tiny_llama, num_speculative_tokens=3, adaptive=False)
    with LLM(tiny_llama, speculative_config=spec, **ENGINE) as spec_llm:
        seeded = _ids(spec_llm.generate([PROMPT], params, use_tqdm=False)[0])
        assert spec_llm.get_stats()["prefix_cache_hits"] == 2 * 48
        assert _ids(spec_llm.generate([PROMPT], params, use_tqdm=False)[0]) == seeded
        assert _ids(spec_llm.generate([PROMPT], greedy, use_tqdm=False)[0]) == want_greedy
        assert spec_llm.get_stats()["num_accepted_tokens"] > 0
