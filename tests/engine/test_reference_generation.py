"""The default model (SmolLM2-135M-Instruct) with the default settings (float32 on CPU, its linear
weights kept Q4_1 and Q8_0, multiplied by activations rounded to 15 bits with AVX-512 VNNI and
widened to float32 with AVX2 only, in float16 where tpspec's CPU kernels do not build:
``--quantization auto``) generates the same greedy tokens as
transformers in float32, loading the same GGUF file through its own, independent GGUF reader."""

from __future__ import annotations


import pytest
import torch

from tests.reference_models import transformers_gguf_model
from tpspec import LLM, SamplingParams
from tpspec.cpu_features import has_fbgemm
from tpspec.default_model import default_model_path
from tpspec.layers import cpu_kernels, int8_dot

# Five tokens each, so transformers runs them as one batch without padding (and a padded batch's
# numerics cannot blur the comparison); the chat prompt runs on its own.
PROMPTS = [
    "The capital of France is",  # transformers stops at EOS before 32 tokens here
    "Write a haiku about",
    "The best way to learn",
    "Once upon a time there",
]
CHAT = [{"role": "user", "content": "What is tensor parallelism?"}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def ours():
    with LLM(num_kv_blocks=64, max_model_len=512) as llm:
        assert llm.llm_engine.config.dtype == "float32"
        assert llm.llm_engine.config.quantization == (
            None if not has_fbgemm() else "fp16" if cpu_kernels.unavailable()
            else "w4a16" if int8_dot.isa() == "avx512_vnni" else "w4a16-fp16")
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        outputs += llm.chat(CHAT, params, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference_model():
    return transformers_gguf_model(default_model_path())


def _reference(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of equal-length prompts, cut after the first EOS."""
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, do_sample=False, top_p=None, top_k=None, temperature=None, pad_token_id=eos,
        )
    refs = []
    for row in out[:, len(prompts[0]) :].tolist():
        refs.append(row[: row.index(eos) + 1] if eos in row else row)
    return refs


def test_greedy_tokens_equal_transformers(ours, reference_model):
    prompts = [p for p, _ in ours]
    assert len({len(p) for p in prompts[: len(PROMPTS)]}) == 1
    refs = _reference(reference_model, prompts[: len(PROMPTS)]) + _reference(reference_model, prompts[len(PROMPTS) :])
    compared_in_full = 0
    for (_, our_ids), ref_ids in zip(ours, refs):
        assert len(our_ids) == MAX_TOKENS
        assert ref_ids, "transformers generated nothing"
        # transformers stops at EOS (and keeps it); we ignore EOS: compare as far as it went.
        assert our_ids[: len(ref_ids)] == ref_ids
        compared_in_full += len(ref_ids) == MAX_TOKENS
    assert compared_in_full >= 3
