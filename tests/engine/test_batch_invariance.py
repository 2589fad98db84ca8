"""Batch invariance (``EngineConfig.batch_invariant``; the default wherever it holds): a request's
greedy tokens and their logprobs are the same bits alone and inside random batches of 1-64 rows of
other requests, with its prompt prefilled whole or in chunks, from cached blocks, and under
EAGLE-3 and n-gram speculation at every k from 1 to 7, and at TP 2: the integer kernels multiply every row alone
(tests/layers/test_int8_dot.py) and every float32 attention reads each query's own keys through the
paged-attention kernel. On the tiny model whose weights are exactly Q4_1 and Q8_0, as a Q4_1
GGUF's (``tiny_gguf_llama``)."""

from __future__ import annotations

import random

import pytest

from tests.models.test_eagle3 import write_eagle3
from tpspec import LLM, SamplingParams
from tpspec.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="no CPU kernels here")

PROMPT = [5, 9, 14, 5, 9, 14, 5, 9, 14, 27, 33, 5, 9, 14, 40, 41] * 2  # 32 tokens, repeats: n-gram drafts
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
ENGINE = dict(num_kv_blocks=512, block_size=8, max_model_len=128, batch_invariant=True, max_num_seqs=64,
              max_num_batched_tokens=4096)


def _tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    o = output.outputs[0]
    return list(o.token_ids), [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]


def _others(n: int, rng: random.Random) -> list[list[int]]:
    """n prompts of 1-40 random tokens."""
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _in_batch(llm: LLM, others: list[list[int]], at: int, params=PARAMS):
    """PROMPT's output when submitted at position ``at`` among ``others`` (each with its own max_tokens)."""
    rng = random.Random(at)
    batch = others[:at] + [PROMPT] + others[at:]
    per_request = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in others]
    params_list = per_request[:at] + [params] + per_request[at:]
    return llm.generate(batch, params_list, use_tqdm=False)[at]


@pytest.fixture(scope="module")
def alone(tiny_gguf_llama) -> tuple[list[int], list[float]]:
    """The reference: PROMPT alone, prefilled whole, no cache, no speculation."""
    with LLM(tiny_gguf_llama, enable_prefix_caching=False, **ENGINE) as llm:
        return _tokens_and_logprobs(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0])


def test_a_request_is_the_same_bits_in_any_batch_from_cached_blocks_and_in_chunks(tiny_gguf_llama, alone):
    rng = random.Random(0)
    with LLM(tiny_gguf_llama, **ENGINE) as llm:
        for size in (1, 7, 63):  # 2, 8 and 64 rows a step
            others = _others(size, rng)
            assert _tokens_and_logprobs(_in_batch(llm, others, rng.randint(0, size))) == alone, size
        # its prompt's blocks cached by the runs above: a hit computes only the last token
        assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
        assert _tokens_and_logprobs(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]) == alone
    chunked = dict(ENGINE, max_num_batched_tokens=8)  # the prompt in 4 chunks, sharing steps with others
    with LLM(tiny_gguf_llama, enable_prefix_caching=False, **chunked) as llm:
        assert _tokens_and_logprobs(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]) == alone
        assert _tokens_and_logprobs(_in_batch(llm, _others(5, rng), 3)) == alone


def test_at_tp_2_too(tiny_gguf_llama):
    """Every rank's shard through the same kernels; the all-reduce of two ranks' partial sums is
    exact in either order."""
    rng = random.Random(2)
    with LLM(tiny_gguf_llama, tensor_parallel_size=2, enable_prefix_caching=False, **ENGINE) as llm:
        ref = _tokens_and_logprobs(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0])
        assert _tokens_and_logprobs(_in_batch(llm, _others(7, rng), 4)) == ref
    with LLM(tiny_gguf_llama, tensor_parallel_size=2, enable_prefix_caching=False,
             **dict(ENGINE, max_num_batched_tokens=8)) as llm:
        assert _tokens_and_logprobs(_in_batch(llm, _others(3, rng), 1)) == ref


@pytest.fixture(scope="module")
def eagle(tiny_gguf_llama, tmp_path_factory) -> str:
    return write_eagle3(str(tmp_path_factory.mktemp("tiny-eagle3-gguf")), seed=4, hidden_size=128,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculation_at_every_k_gives_the_same_bits(tiny_gguf_llama, eagle, alone, method):
    rng = random.Random(1)
    for k in range(1, 8):
        spec = dict(method=method, num_speculative_tokens=k, adaptive=False)
        spec.update(dict(model=eagle) if method == "eagle3" else dict(prompt_lookup_max=3, prompt_lookup_min=1))
        with LLM(tiny_gguf_llama, speculative_config=spec, **ENGINE) as llm:
            assert _tokens_and_logprobs(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]) == alone, k
            assert _tokens_and_logprobs(_in_batch(llm, _others(rng.randint(1, 20), rng), 1)) == alone, k
            stats = llm.llm_engine.get_stats()
            assert stats["num_draft_tokens"] > 0, k  # the k + 1-row verification ran


def test_weights_outside_the_integer_kernels_are_refused(tiny_llama):
    with pytest.raises(Exception, match="batch_invariant needs every linear weight in the integer kernels"):
        LLM(tiny_llama, **ENGINE)
