"""``quantization="fp16"`` (what ``auto`` picks for float32 on CPU): a float32 model's linear
weights stored in float16 and multiplied in float32 (fbgemm). It is the float32 engine on weights
rounded to float16 (logprobs within float32 rounding of that engine's, apart from the unrounded
one's), and keeps the invariants: TP 2 gives TP 1's greedy and seeded tokens, speculative decoding
with the flag on gives plain decoding's. ``quantization="q4_1"``: weights that are exactly Q4_1
kept 4-bit; the float32 engine on the same weights, with the same invariants. ``"w4a16"`` and
``"w4a8"``: those weights and the exactly-Q8_0 LM head times activations rounded to 15 or 8 bits
(integer kernels): the float32 engine's tokens, logprobs within the rounding, the same invariants."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from tpspec import LLM, SamplingParams
from tpspec.layers.cpu_weights import resolve_quantization
from tpspec.cpu_features import has_fbgemm
from tpspec.layers import cpu_kernels, int8_dot
from tests.conftest import copy_with_weights, exactly_q4_1, write_tiny_dflash

pytestmark = pytest.mark.skipif(not has_fbgemm(), reason="this torch build has no fbgemm")
needs_q4_1_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="no Q4_1 kernel here")

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown", "import"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
SEEDED = [SamplingParams(temperature=1.2, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(2)]
ENGINE = dict(num_kv_blocks=64, max_model_len=128)


def _run(folder: str, tp: int = 1, **kw) -> dict:
    with LLM(folder, tensor_parallel_size=tp, **ENGINE, **kw) as llm:
        greedy = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], SEEDED, use_tqdm=False)]
    return dict(greedy=[list(o.token_ids) for o in greedy], seeded=seeded,
                logprobs=torch.tensor([lp[t] for o in greedy for t, lp in zip(o.token_ids, o.logprobs)]))


def _assert_tp_and_speculative_invariants(folder: str, quantization: str, dflash: str) -> None:
    """TP 2 gives TP 1's greedy and seeded tokens; speculative decoding (flag on) gives plain's."""
    spec = dict(method="dflash", model=dflash, num_speculative_tokens=3, use_local_argmax_reduction=True,
                adaptive=False)  # a fixed k: an untrained drafter would be switched off
    tp1 = _run(folder, quantization=quantization)
    tp2 = _run(folder, 2, quantization=quantization)
    spec1 = _run(folder, quantization=quantization, speculative_config=spec)
    spec2 = _run(folder, 2, quantization=quantization, speculative_config=spec)
    assert tp2["greedy"] == tp1["greedy"] and tp2["seeded"] == tp1["seeded"]
    assert spec1["greedy"] == tp1["greedy"] and spec2["greedy"] == tp1["greedy"]
    assert spec2["seeded"] == spec1["seeded"]


@pytest.fixture(scope="module")
def rounded_llama(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with its linear weights rounded to float16 (and stored as float32 again)."""
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    rounded = {k: v.half().float() if k.endswith("proj.weight") or k == "lm_head.weight" else v for k, v in weights.items()}
    assert any(not torch.equal(rounded[k], weights[k]) for k in weights)
    return copy_with_weights(tiny_llama, str(tmp_path_factory.mktemp("tiny-llama-fp16-rounded")), rounded)


def test_fp16_weights_are_the_float32_engine_on_rounded_weights(tiny_llama, rounded_llama):
    quantized = _run(tiny_llama, quantization="fp16")
    on_rounded = _run(rounded_llama, quantization="none")
    unrounded = _run(tiny_llama, quantization="none")
    assert _run(tiny_llama)["logprobs"].tolist() == quantized["logprobs"].tolist()  # auto: fp16 on CPU
    assert quantized["greedy"] == on_rounded["greedy"]
    if unrounded["greedy"] == quantized["greedy"]:  # the same tokens: their logprobs show which weights ran
        gap_to_rounded = (quantized["logprobs"] - on_rounded["logprobs"]).abs().max().item()
        gap_to_unrounded = (quantized["logprobs"] - unrounded["logprobs"]).abs().max().item()
        assert gap_to_rounded < 1e-4 < gap_to_unrounded


def test_fp16_weights_keep_tp_and_speculative_invariants(tiny_llama, tiny_dflash):
    _assert_tp_and_speculative_invariants(tiny_llama, "fp16", tiny_dflash)


@pytest.fixture(scope="module")
def q4_1_llama(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with its layers' weights made exactly Q4_1 and float16 (``exactly_q4_1``): the Q4_1
    kernel, fbgemm's float16 GEMM (more rows, and the shards of 48 columns at TP 2) and float32 read
    the same weights; the LM head rounded to float16."""
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for k, v in weights.items():
        if k.endswith("proj.weight"):
            weights[k] = exactly_q4_1(v, g)
        elif k == "lm_head.weight":  # not Q4_1: in float16 either way
            weights[k] = v.half().float()
    return copy_with_weights(tiny_llama, str(tmp_path_factory.mktemp("tiny-llama-q4_1")), weights)


@needs_q4_1_kernel
def test_q4_1_weights_are_the_float32_engine(q4_1_llama):
    q4_1 = _run(q4_1_llama, quantization="q4_1")
    none = _run(q4_1_llama, quantization="none")
    assert q4_1["greedy"] == none["greedy"] and q4_1["seeded"] == none["seeded"]
    assert (q4_1["logprobs"] - none["logprobs"]).abs().max().item() < 1e-4


@needs_q4_1_kernel
def test_q4_1_weights_keep_tp_and_speculative_invariants(q4_1_llama, tiny_dflash):
    _assert_tp_and_speculative_invariants(q4_1_llama, "q4_1", tiny_dflash)


@needs_q4_1_kernel
@pytest.mark.parametrize("rows", [1, 8, 9, 32])
def test_w4a16_fp16_is_w4a16_up_to_8_rows_and_the_float16_copy_past_them(rows):
    """``w4a16-fp16`` (``auto`` on AVX2-only CPUs): an exactly-Q4_1 weight's products of up to
    QUANTIZED_MAX_ROWS rows have ``w4a16``'s bits, of more the float16 copy's (``fp16``), through the
    layer's plan as through ``linear``."""
    from tpspec.layers.cpu_weights import QUANTIZED_MAX_ROWS, linear, packed_weight_of
    from tpspec.models.layer_plans import LinearPlan

    g = torch.Generator().manual_seed(rows)
    weights = {fmt: exactly_q4_1(torch.empty(96, 128), g) for fmt in ("w4a16-fp16", "w4a16", "fp16")}
    weights["w4a16"].copy_(weights["w4a16-fp16"])
    weights["fp16"].copy_(weights["w4a16-fp16"])
    packed = {fmt: packed_weight_of(w, fmt) for fmt, w in weights.items()}
    assert packed["w4a16-fp16"].format == "q4_1_int8_fp16"
    x = torch.randn(rows, 128, generator=g)
    out = linear(x, weights["w4a16-fp16"], None, packed["w4a16-fp16"])
    same_as = "w4a16" if rows <= QUANTIZED_MAX_ROWS else "fp16"
    assert torch.equal(out, linear(x, weights[same_as], None, packed[same_as]))
    layer = torch.nn.Linear(128, 96, bias=False)
    layer.weight.data = weights["w4a16-fp16"]
    layer.packed_weight = lambda: packed_weight_of(layer.weight, "w4a16-fp16")
    assert torch.equal(LinearPlan(layer, reduce=False)(x), out)


@needs_q4_1_kernel
def test_w4a16_fp16_keeps_tp_and_speculative_invariants(tiny_gguf_llama, gguf_dflash):
    _assert_tp_and_speculative_invariants(tiny_gguf_llama, "w4a16-fp16", gguf_dflash)


@pytest.fixture(scope="module")
def gguf_dflash(tiny_gguf_llama, tmp_path_factory) -> str:
    return write_tiny_dflash(str(tmp_path_factory.mktemp("tiny-dflash-gguf")), tiny_gguf_llama)


@needs_q4_1_kernel
def test_w4a16_is_the_float32_engine_up_to_the_activations_rounding(tiny_gguf_llama, caplog):
    """(w4a8's 8-bit activations change this tiny random model's first greedy token: its kernel is
    checked against a reference in tests/layers/test_int8_dot.py, its invariants below.)"""
    with caplog.at_level(logging.INFO, logger="tpspec.layers.cpu_weights"):
        quantized = _run(tiny_gguf_llama, quantization="w4a16")
    # every linear weight through the integer kernels: 3 layers' 4 products, and the LM head
    assert "LlamaForCausalLM: linear weights by format: 12 q4_1_int8, 1 q8_0_int8" in caplog.text
    none = _run(tiny_gguf_llama, quantization="none")
    assert quantized["greedy"] == none["greedy"] and quantized["seeded"] == none["seeded"]
    gap = (quantized["logprobs"] - none["logprobs"]).abs().max().item()
    assert 0 < gap < 0.02  # rounded activations: close to float32's (0.004 here), not equal


@needs_q4_1_kernel
@pytest.mark.parametrize("method", ["w4a16", "w4a8"])
def test_integer_kernels_keep_tp_and_speculative_invariants(tiny_gguf_llama, gguf_dflash, method):
    _assert_tp_and_speculative_invariants(tiny_gguf_llama, method, gguf_dflash)


def test_bad_quantization_options_are_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"quantization must be one of \('auto', 'none', 'fp16', 'q4_1', 'w4a8', 'w4a16', 'w4a16-fp16'\), got 'int3'"):
        LLM(tiny_llama, quantization="int3", **ENGINE)
    with pytest.raises(ValueError, match="quantization='fp16' stores a float32 model's weights in float16"):
        LLM(tiny_llama, quantization="fp16", dtype="bfloat16", **ENGINE)
    with pytest.raises(ValueError, match="quantization='q4_1' multiplies float32 activations"):
        LLM(tiny_llama, quantization="q4_1", dtype="float16", **ENGINE)
    with pytest.raises(ValueError, match=r"batch_invariant needs an integer-kernel quantization \('w4a16', 'w4a8'\)"):
        LLM(tiny_llama, quantization="q4_1", batch_invariant=True, **ENGINE)
    with pytest.raises(ValueError, match="batch_invariant and torch_compile exclude each other"):
        LLM(tiny_llama, batch_invariant=True, torch_compile=True, **ENGINE)


def test_auto_is_w4a16_with_vnni_w4a16_fp16_on_avx2_else_fp16_only_for_float32_on_cpu(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: None)
    monkeypatch.setattr(int8_dot, "isa", lambda: "avx512_vnni")
    assert resolve_quantization("auto", "float32", "cpu") == "w4a16"
    monkeypatch.setattr(int8_dot, "isa", lambda: "avx2")
    assert resolve_quantization("auto", "float32", "cpu") == "w4a16-fp16"
    assert resolve_quantization("auto", "float32", "cpu", batch_invariant=True) == "w4a16"
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "the CPU lacks avx2")
    assert resolve_quantization("auto", "float32", "cpu") == "fp16"
    assert resolve_quantization("auto", "bfloat16", "cpu") is None
    assert resolve_quantization("auto", "float16", "cpu") is None
    assert resolve_quantization("auto", "float32", "cuda") is None
    assert resolve_quantization("none", "float32", "cpu") is None
