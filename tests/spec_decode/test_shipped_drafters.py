"""The drafters shipped for the default model, used by a speculative config without ``model``
(``{"method": "dflash"}``, ``{"method": "eagle3"}``): at TP 2, flag on and off, greedy output
equals plain greedy output and drafts are accepted. The alias ``eagle`` is the same row of the
methods table, so it resolves to the same drafter (tests/spec_decode/test_spec_config.py)."""

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


@pytest.mark.parametrize("method,folder", [("dflash", "smollm2-135m-dflash"), ("eagle3", "smollm2-135m-eagle3")])
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


def test_only_the_shipped_eagle3_heads_are_rounded(tmp_path):
    """The methods table rounds the shipped EAGLE-3 heads only (the shipped DFlash drafter accepts
    less rounded, and drafts no faster); a user's head, or a user's copy of a shipped one, stays
    as loaded."""
    from tpspec.config.speculative_methods import get_method
    from tpspec.spec_decode.resolve import is_shipped_drafter, shipped_drafter

    assert get_method("eagle3").rounds_shipped_drafter_to_q4_1 and get_method("eagle").rounds_shipped_drafter_to_q4_1
    assert not get_method("dflash").rounds_shipped_drafter_to_q4_1
    head = shipped_drafter(get_method("eagle3"), None)
    assert is_shipped_drafter(head) and is_shipped_drafter(shipped_drafter(get_method("dflash"), "gemma-3-270m"))
    assert not is_shipped_drafter(str(tmp_path)) and not is_shipped_drafter(None)


def test_the_shipped_head_is_rounded_to_q4_1_alike_at_every_tp_size(monkeypatch):
    """Under q4_1 (the default where the kernels build) a shipped drafter's own weights are rounded
    to Q4_1, row-parallel layers too where their input slice starts on a group boundary (the
    shipped head's do at TP 1 and 2): the same drafts at TP 1 and 2 (sharding invariance)."""
    from tpspec.layers import cpu_kernels
    from tpspec.layers.q4_1 import quantize_exact
    from tpspec.spec_decode.eagle import Eagle3Proposer

    if cpu_kernels.unavailable():
        pytest.skip(f"no q4_1 here: {cpu_kernels.unavailable()}")
    recorded: list = []
    propose = Eagle3Proposer.propose

    def recording(self, inp):
        fed = propose(self, inp)
        recorded.append([self.drafts(r) for r in inp.req_ids])
        return fed

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False}
    drafts = {}
    for tp in (1, 2):
        recorded.clear()
        with LLM(None, speculative_config=spec, **{**ENGINE, "tensor_parallel_size": tp}) as llm:
            if tp == 1:
                head = llm.llm_engine.executor.runner.speculator.model
                assert quantize_exact(head.fc.weight) is not None and quantize_exact(head.lm_head.weight) is not None
                assert quantize_exact(head.midlayer.self_attn.o_proj.weight) is not None  # row-parallel, whole groups
                assert quantize_exact(head.midlayer.mlp.down_proj.weight) is not None
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        drafts[tp] = list(recorded)
    assert sum(len(d) for step in drafts[1] for d in step) > 30
    assert drafts[1] == drafts[2]
