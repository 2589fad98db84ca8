"""``method: eagle3`` end to end through ``LLM``, with a tiny random EAGLE-3 checkpoint for the tiny
Llama target (draft vocab 500 of 1000, non-trivial d2t).

* Greedy losslessness: speculative output == plain output token for token at TP 1 and 2, the flag
  on and off, ``eagle`` as an alias, and (TP 2) with a replicated midlayer
  (draft_tensor_parallel_size 1) under probabilistic drafting, whose draft distribution covers
  the target vocab (zero outside the draft vocab); prompts of different lengths in one batch,
  one long enough to be prefilled in chunks, one cut by max_tokens, a seeded sampled request
  mixed in. KV blocks are all free afterwards.
* With the flag at TP 2, draft.sample moves 8·tp bytes per draft row; without, 4·padded draft vocab
  (512), not the target's 1024.
* Token alignment in the engine: on a bigram target (attention and MLP outputs zeroed: the next
  token is a function of the current one), a head built to compute that function through its own
  machinery (row t attends only to itself and reads the embedding of token t + 1) has every draft
  accepted, at TP 1 and 2; rows fed token t instead of t + 1 get none. (Positions are checked against the
  reference in tests/models/test_eagle3.py: this head is blind to them.)
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.test_eagle3 import HEAD, write_eagle3
from tpspec import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import",
    list(range(40, 76)),  # 36 tokens: prefilled in chunks under max_num_batched_tokens=24
]
MAX_TOKENS = 16
ENGINE = dict(num_kv_blocks=96, block_size=8, max_model_len=128, max_num_batched_tokens=24)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # drafts are cut to fit
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
DRAFT_PADDED_VOCAB = 512


def _spec(model: str, flag: bool, **kw) -> dict:
    return dict(dict(method="eagle3", model=model, num_speculative_tokens=3, use_local_argmax_reduction=flag, adaptive=False), **kw)


CASES = {
    "flag-tp1": (1, dict(flag=True)),
    "noflag-alias-tp1": (1, dict(flag=False, method="eagle")),
    "flag-tp2": (2, dict(flag=True)),
    "noflag-tp2": (2, dict(flag=False)),
    "replicated-probabilistic-tp2": (2, dict(flag=False, draft_tensor_parallel_size=1, draft_sample_method="probabilistic")),
}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory) -> str:
    return write_eagle3(str(tmp_path_factory.mktemp("tiny-eagle3")), seed=4)


_PLAIN: dict = {}
_RUNS: dict = {}


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _plain(target: str, tp: int) -> list[list[int]]:
    if tp not in _PLAIN:
        with LLM(target, tensor_parallel_size=tp, **ENGINE) as llm:
            _PLAIN[tp] = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    return _PLAIN[tp]


def _run(case: str, target: str, eagle: str) -> dict:
    if case not in _RUNS:
        tp, kw = CASES[case]
        with LLM(target, tensor_parallel_size=tp, speculative_config=_spec(eagle, **kw), **ENGINE) as llm:
            prompts = PROMPTS + PROMPTS[:2]
            params = [GREEDY] * len(PROMPTS) + [SHORT, SEEDED]
            outs = _ids(llm.generate(prompts, params, use_tqdm=False))
            _RUNS[case] = dict(greedy=outs[: len(PROMPTS)], short=outs[len(PROMPTS)], seeded=outs[-1], stats=llm.get_stats())
    return _RUNS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_output(case, tiny_llama, eagle):
    tp = CASES[case][0]
    ref = _plain(tiny_llama, tp)
    run = _run(case, tiny_llama, eagle)
    assert run["greedy"] == ref
    assert run["short"] == ref[0][:5]
    assert len(run["seeded"]) == MAX_TOKENS and run["seeded"] != ref[1]
    s = run["stats"]
    assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_draft_sample_bytes_per_row_tp2(tiny_llama, eagle):
    """Greedy drafting is identical with the flag on and off (same rows drafted): on, each row
    moves 8·tp bytes; off, the draft-vocab logits (4·512 bytes), never the target vocab's."""
    on = _run("flag-tp2", tiny_llama, eagle)["stats"]["comm"]["draft.sample"]
    off = _run("noflag-tp2", tiny_llama, eagle)["stats"]["comm"]["draft.sample"]
    probabilistic = _run("replicated-probabilistic-tp2", tiny_llama, eagle)["stats"]["comm"]["draft.sample"]
    rows = off["bytes"] / (4 * DRAFT_PADDED_VOCAB)
    assert rows == on["bytes"] / (8 * 2) == int(rows) > 0
    assert on["calls"] == off["calls"] > 0
    # Under a replicated midlayer the draft LM head stays vocab-parallel; probabilistic drafting
    # gathers its logits, over the draft vocab.
    assert probabilistic["calls"] > 0 and probabilistic["bytes"] % (4 * DRAFT_PADDED_VOCAB) == 0


# ---- alignment: a head that mirrors a bigram target ---------------------------------------------


def _bigram_target(src: str, dst: str) -> str:
    """``src`` with every attention and MLP output projection zeroed: logits = lm_head(norm(embed(x)))."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    zeroed = {k: (0 * v if k.endswith(("o_proj.weight", "down_proj.weight")) else v) for k, v in weights.items()}
    save_file(zeroed, os.path.join(dst, "model.safetensors"))
    return dst


def _bigram_eagle3(folder: str, target: str) -> str:
    """Row t: q and k are large constant biases, so after RoPE each row attends to itself alone;
    v = input_layernorm(embedding of token t + 1), o = identity, the hidden path and the MLP output
    are zeroed; final norm and LM head are the target's (restricted to a draft vocab holding every
    bigram successor). So the head predicts the target's token after token t + 1."""
    t = load_file(os.path.join(target, "model.safetensors"))
    embed, lm_head, norm = t["model.embed_tokens.weight"], t["lm_head.weight"], t["model.norm.weight"]
    successor = (lm_head @ (embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5) * norm).T).argmax(0)
    others = torch.tensor([i for i in range(1000) if i not in set(successor.tolist())])
    ids = torch.cat([successor.unique(), others[: 640 - len(successor.unique())]]).sort().values
    h = 96
    return write_eagle3(folder, num_key_value_heads=4, attention_bias=True, norm_before_residual=True, draft_vocab_size=640, overrides={
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.zeros(h),  # with norm_before_residual: no residual either
        "midlayer.self_attn.q_proj.weight": torch.zeros(h, 2 * h),
        "midlayer.self_attn.q_proj.bias": torch.full((h,), 10.0),
        "midlayer.self_attn.k_proj.weight": torch.zeros(h, 2 * h),
        "midlayer.self_attn.k_proj.bias": torch.full((h,), 10.0),
        "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1),
        "midlayer.self_attn.v_proj.bias": torch.zeros(h),
        "midlayer.self_attn.o_proj.weight": torch.eye(h),
        "midlayer.self_attn.o_proj.bias": torch.zeros(h),
        "midlayer.mlp.down_proj.weight": torch.zeros(h, HEAD["intermediate_size"]),
        "norm.weight": norm,
        "lm_head.weight": lm_head[ids],
        "d2t": ids - torch.arange(640),
    })


@pytest.mark.parametrize("tp,flag", [(1, True), (2, True), (2, False)])
def test_bigram_head_has_every_draft_accepted(tiny_llama, tmp_path, tp, flag):
    """Acceptance at TP 2 too: a verifier (or sharded drafting) that rejected every draft would
    still pass the losslessness tests above."""
    target = _bigram_target(tiny_llama, str(tmp_path / "bigram-target"))
    head = _bigram_eagle3(str(tmp_path / "bigram-eagle3"), target)
    with LLM(target, tensor_parallel_size=tp, **ENGINE) as llm:
        ref = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(target, tensor_parallel_size=tp, speculative_config=_spec(head, flag), **ENGINE) as llm:
        out = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        s = llm.get_stats()
    assert out == ref
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] >= 3 * (MAX_TOKENS // 4)
