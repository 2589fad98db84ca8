"""``method: mtp`` end to end through ``LLM``, with tiny random MTP modules for the tiny Llama target.

* Greedy losslessness: speculative output == plain output token for token at TP 1 and 2, the flag
  on and off, two MTP layers taking turns, and (TP 2) replicated MTP blocks
  (draft_tensor_parallel_size 1) under probabilistic drafting; prompts of different lengths in one
  batch, one prefilled in chunks, one cut by max_tokens, a seeded sampled request mixed in. KV
  blocks are all free afterwards.
* ``{"method": "mtp"}`` without a model reads the target's own checkpoint, whose MTP layer follows
  its decoder layers (the target skips it).
* With the flag at TP 2, draft.sample moves 8·tp bytes per draft row; without, the full padded
  vocabulary's logits (4·1024 bytes).
* Token alignment in the engine: on a bigram target (attention and MLP outputs zeroed: the next
  token is a function of the current one), an MTP module that computes that function of the token
  it is fed (eh_proj passes enorm(embedding), the block adds nothing, shared_head.norm is the
  target's final norm) has every draft accepted, at TP 1 and 2.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.test_mtp import write_mtp
from tests.spec_decode.test_eagle import (
    ENGINE, GREEDY, MAX_TOKENS, PROMPTS, SEEDED, SHORT, _bigram_target, _ids, _plain,
)
from tpspec import LLM

PADDED_VOCAB = 1024


def _spec(model: str | None, flag: bool, **kw) -> dict:
    spec = dict(method="mtp", num_speculative_tokens=3, use_local_argmax_reduction=flag, adaptive=False, **kw)
    return spec if model is None else dict(spec, model=model)


# name: (tp, which module, spec keywords)
CASES = {
    "flag-tp1": (1, "one", dict(flag=True)),
    "noflag-two-layers-tp1": (1, "two", dict(flag=False)),
    "flag-tp2": (2, "one", dict(flag=True)),
    "noflag-tp2": (2, "one", dict(flag=False)),
    "replicated-probabilistic-tp2": (2, "one", dict(flag=True, draft_tensor_parallel_size=1, draft_sample_method="probabilistic")),
    "in-target-checkpoint-tp1": (1, "whole", dict(flag=True)),
}


@pytest.fixture(scope="module")
def modules(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-mtp")
    return {
        "one": write_mtp(str(root / "one"), tiny_llama, seed=4),
        "two": write_mtp(str(root / "two"), tiny_llama, seed=5, num_layers=2),
        "whole": write_mtp(str(root / "whole"), tiny_llama, seed=6, whole_target=True),
    }


_RUNS: dict = {}


def _run(case: str, target: str, modules: dict) -> dict:
    if case not in _RUNS:
        tp, which, kw = CASES[case]
        if which == "whole":  # the target is the checkpoint holding the MTP layer; no model named
            target, model = modules["whole"], None
        else:
            model = modules[which]
        with LLM(target, tensor_parallel_size=tp, speculative_config=_spec(model, **kw), **ENGINE) as llm:
            prompts = PROMPTS + PROMPTS[:2]
            params = [GREEDY] * len(PROMPTS) + [SHORT, SEEDED]
            outs = _ids(llm.generate(prompts, params, use_tqdm=False))
            _RUNS[case] = dict(greedy=outs[: len(PROMPTS)], short=outs[len(PROMPTS)], seeded=outs[-1], stats=llm.get_stats())
    return _RUNS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_output(case, tiny_llama, modules):
    ref = _plain(tiny_llama, CASES[case][0])
    run = _run(case, tiny_llama, modules)
    assert run["greedy"] == ref
    assert run["short"] == ref[0][:5]
    assert len(run["seeded"]) == MAX_TOKENS and run["seeded"] != ref[1]
    s = run["stats"]
    assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_draft_sample_bytes_per_row_tp2(tiny_llama, modules):
    """Greedy drafting is identical with the flag on and off (same rows drafted): on, each row
    moves 8·tp bytes; off, the padded vocabulary's logits."""
    on = _run("flag-tp2", tiny_llama, modules)["stats"]["comm"]["draft.sample"]
    off = _run("noflag-tp2", tiny_llama, modules)["stats"]["comm"]["draft.sample"]
    rows = off["bytes"] / (4 * PADDED_VOCAB)
    assert rows == on["bytes"] / (8 * 2) == int(rows) > 0
    assert on["calls"] == off["calls"] > 0


# ---- alignment: a module that mirrors a bigram target -------------------------------------------


def _bigram_mtp(folder: str, target: str) -> str:
    """eh_proj = [I | 0] passes enorm(embedding of the token fed), the block's output projections
    are zeroed (it adds nothing to its residual), and shared_head.norm is the target's final norm:
    the module predicts the target's token after the token it is fed (token t + 1 on row t)."""
    write_mtp(folder, target)
    path = os.path.join(folder, "model.safetensors")
    t, norm = load_file(path), load_file(os.path.join(target, "model.safetensors"))["model.norm.weight"]
    h = norm.shape[0]
    t.update({
        "model.layers.3.enorm.weight": torch.ones(h),
        "model.layers.3.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1),
        "model.layers.3.self_attn.o_proj.weight": 0 * t["model.layers.3.self_attn.o_proj.weight"],
        "model.layers.3.mlp.down_proj.weight": 0 * t["model.layers.3.mlp.down_proj.weight"],
        "model.layers.3.shared_head.norm.weight": norm,
    })
    save_file({k: v.contiguous() for k, v in t.items()}, path)
    return folder


@pytest.mark.parametrize("tp,flag", [(1, True), (2, True), (2, False)])
def test_bigram_module_has_every_draft_accepted(tiny_llama, tmp_path, tp, flag):
    """Acceptance at TP 2 too: a verifier (or sharded drafting) that rejected every draft would
    still pass the losslessness tests above. Prompts of two tokens or more: a one-token prompt's
    first draft comes from the row at position 0, whose token MTP masks (as vLLM does)."""
    target = _bigram_target(tiny_llama, str(tmp_path / "bigram-target"))
    module = _bigram_mtp(str(tmp_path / "bigram-mtp"), target)
    prompts = [p for p in PROMPTS if p != "import"]
    with LLM(target, tensor_parallel_size=tp, **ENGINE) as llm:
        ref = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(target, tensor_parallel_size=tp, speculative_config=_spec(module, flag), **ENGINE) as llm:
        out = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        s = llm.get_stats()
    assert out == ref
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] >= 3 * (MAX_TOKENS // 4)
