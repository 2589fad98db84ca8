"""The drafters shipped for the default model, used by a speculative config without ``model``
(``{"method": "dflash"}``, ``{"method": "eagle3"}`` and its alias ``eagle``): at TP 2, flag on and
off, greedy output equals plain greedy output and drafts are accepted."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.models.loader.resolve import resolve_model

PROMPTS = ["def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
           "Write a haiku about the sea."]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ENGINE = dict(tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with LLM(resolve_model(None), **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,folder", [("dflash", "smollm2-135m-dflash"), ("eagle3", "smollm2-135m-eagle3"),
                                           ("eagle", "smollm2-135m-eagle3")])
@pytest.mark.parametrize("flag", [False, True])
def test_the_shipped_drafter_is_lossless(plain, method, folder, flag):
    spec = {"method": method, "num_speculative_tokens": 5, "adaptive": False, "use_local_argmax_reduction": flag}
    with LLM(None, speculative_config=spec, **ENGINE) as llm:
        assert llm.llm_engine.config.speculative.model.endswith(folder)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert stats["num_accepted_tokens"] > 0
    assert stats["comm_bytes_per_row"]["draft.sample"] == (8 * 2 if flag else 4 * 8192 if method != "dflash" else 4 * 49152)
