"""Adding a drafting method is one speculator class and one row of the methods table: a toy
method ("repeat the last token"), defined and registered here alone, runs in the engine and
leaves greedy output unchanged, with a fixed k and with the adaptive controller."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.config import speculative_methods
from tpspec.config.speculative_methods import LOOKUP, SpeculativeMethod, register_method
from tpspec.spec_decode.speculator import DraftInput, DraftState, Speculator

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE = dict(num_kv_blocks=48, max_model_len=128)


class RepeatLastToken(Speculator):
    """Drafts the request's newest token, repeated."""

    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        for i in inp.proposing:
            states[i].draft_ids = [inp.token_ids[i][-1]] * inp.num_drafts[i]
        return 0


@pytest.fixture
def repeat_method(monkeypatch):
    monkeypatch.setattr(speculative_methods, "METHODS", dict(speculative_methods.METHODS))  # undone after the test
    return register_method(SpeculativeMethod(
        "repeat_last", RepeatLastToken, LOOKUP, uses_model=False, default_num_speculative_tokens=3,
    ))


def test_a_registered_method_is_refused_twice(repeat_method):
    with pytest.raises(ValueError, match=r"\['repeat_last'\] are taken"):
        register_method(repeat_method)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_toy_method_registered_from_a_test_is_lossless(tiny_llama, repeat_method, adaptive):
    with LLM(tiny_llama, **ENGINE) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = {"method": "repeat_last", "adaptive": adaptive}
    with LLM(tiny_llama, speculative_config=spec, **ENGINE) as llm:
        assert isinstance(llm.llm_engine.executor.runner.speculator, RepeatLastToken)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert stats["num_draft_tokens"] > 0  # drafts were verified (and rejected: the random model rarely repeats)
