"""Layer plans (models/layer_plans.py): a decoder layer's float32 CPU step as direct kernel calls
gives the bits of the same step through the layer's modules (hidden states, captured layers, logits
and the KV cache), for Llama, Qwen3 (per-head q/k norms) and Gemma 3 (four norms, GELU, sliding
windows) layers, every packed weight format, float32 and float16 caches, prefill chunks, decodes
and verification rows, at TP 1 and 2; plans follow a re-packed weight; a model whose layers have
none (a bias) runs its modules."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed
from tpspec.config import ModelArchConfig
from tpspec.layers import cpu_kernels
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache
from tpspec.layers.cpu_weights import pack_cpu_weights
from tpspec.models import llama
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.registry import get_model_class

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")

BLOCK = 4
TABLES = [[1, 5, 9, 13, 17, 21], [2, 3, 4, 6, 7, 8]]
# (query_lens, context_lens) of two sequences: prefill chunks, decodes, a 4-row verification beside a decode
STEPS = [([7, 5], [7, 5]), ([3, 1], [10, 6]), ([1, 1], [11, 7]), ([4, 1], [15, 8]), ([1, 4], [16, 12])]


def _load(folder: str, quantization: str | None) -> torch.nn.Module:
    arch = ModelArchConfig.from_folder(folder)
    model = get_model_class(arch.architecture)(arch, torch.float32)
    model.load_weights(iterate_weights(folder, show_progress=False))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the checkpoint's norms are all ones: make each layer's two norms differ
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=g))
    pack_cpu_weights(model, quantization)
    return model


def _run(model, caches, use_plans: bool) -> list[torch.Tensor]:
    """Every step's final hidden states, captured layers 0 and 2, and logits, in order."""
    model.use_layer_plans = use_plans
    g = torch.Generator().manual_seed(0)
    outs = []
    with torch.inference_mode():
        for query_lens, context_lens in STEPS:
            md = AttentionMetadata.build(query_lens, context_lens, TABLES, BLOCK, torch.device("cpu"))
            ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=g)
            pos = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
            hidden, captured = model(ids, pos, caches, md, capture_layers=(0, 2))
            outs += [hidden, captured[0], captured[2], model.compute_logits(hidden)]
    return outs


def _compare(folder: str, quantization: str | None, cache_dtype: torch.dtype) -> dict:
    """The plans' and the modules' outputs and caches on the same steps (on this rank)."""
    cpu_kernels.kernels()
    model = _load(folder, quantization)
    caches = [allocate_kv_cache(len(model.layers), 32 * BLOCK, model.kv_cache_shape, cache_dtype) for _ in range(2)]
    calls = {"modules": 0}
    attention_forward = llama.LlamaAttention.forward

    def counted(self, *args):
        calls["modules"] += 1
        return attention_forward(self, *args)

    llama.LlamaAttention.forward = counted
    try:
        planned = _run(model, caches[0], True)
        through_plans = calls["modules"]
        modules = _run(model, caches[1], False)
    finally:
        llama.LlamaAttention.forward = attention_forward
    return {
        "plans_built": len(model._layer_plans or []),
        "module_calls_with_plans": through_plans,
        "module_calls_without": calls["modules"] - through_plans,
        "outputs_equal": [torch.equal(a, b) for a, b in zip(planned, modules)],
        "caches_equal": all(torch.equal(a, b) for la, lb in zip(*caches) for a, b in zip(la, lb)),
    }


def _assert_same_bits(r: dict, layers: int = 3) -> None:
    assert r["plans_built"] == layers and r["module_calls_with_plans"] == 0  # the plans ran every layer
    assert r["module_calls_without"] == layers * len(STEPS)
    assert all(r["outputs_equal"]), r["outputs_equal"]
    assert r["caches_equal"]


@pytest.mark.parametrize("quantization", [None, "fp16", "q4_1", "w4a16", "w4a8"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_plans_give_the_bits_of_the_modules(tiny_gguf_llama, quantization, cache_dtype):
    """None: float32 weights through oneDNN; "fp16": fbgemm; "q4_1": tpspec's Q4_1/Q8_0 kernels and
    their float16 copy past 8 rows; "w4a16", "w4a8": the integer kernels, called directly."""
    _assert_same_bits(_compare(tiny_gguf_llama, quantization, cache_dtype))


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("quantization", [None, "fp16"])
def test_qwen3_and_gemma3_plans_give_the_bits_of_the_modules(model, quantization, request):
    """Per-head q/k norms before the rotation (both), Gemma's four norms, GELU and sliding windows."""
    _assert_same_bits(_compare(request.getfixturevalue(model), quantization, torch.float16))


def test_plans_give_the_bits_of_the_modules_at_tp_2(tiny_gguf_llama):
    """Row-parallel products all-reduced inside the plan as in the modules (gloo)."""
    for r in run_distributed(_compare, 2, tiny_gguf_llama, "w4a16", torch.float16):
        _assert_same_bits(r)


def test_plans_follow_a_re_packed_weight(tiny_gguf_llama):
    cpu_kernels.kernels()
    model = _load(tiny_gguf_llama, "q4_1")
    caches = allocate_kv_cache(len(model.layers), 32 * BLOCK, model.kv_cache_shape, torch.float32)
    _run(model, caches, True)
    before = model._layer_plans
    pack_cpu_weights(model, "w4a16")  # the same weights in the integer kernels' layout
    planned = _run(model, caches, True)
    assert model._layer_plans and model._layer_plans is not before
    assert all(torch.equal(a, b) for a, b in zip(planned, _run(model, caches, False)))
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(2)  # changed in place: packed again on next use
    planned = _run(model, caches, True)
    assert all(torch.equal(a, b) for a, b in zip(planned, _run(model, caches, False)))
    weight = model.layers[2].self_attn.o_proj.weight
    weight.data = weight.data * 2  # new storage, the version unchanged: packed again on next use
    planned = _run(model, caches, True)
    assert all(torch.equal(a, b) for a, b in zip(planned, _run(model, caches, False)))


def test_a_model_whose_layers_have_no_plan_runs_its_modules(tmp_path):
    """Projections with a bias: no plan, the modules every step."""
    from tests.conftest import _write_tiny

    cpu_kernels.kernels()
    model = _load(_write_tiny(str(tmp_path), "llama", attention_bias=True), None)
    caches = allocate_kv_cache(len(model.layers), 32 * BLOCK, model.kv_cache_shape, torch.float32)
    _run(model, caches, True)
    assert model._layer_plans == []


@pytest.mark.parametrize("quantization", [None, "w4a16"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_eagle3_midlayers_plan_gives_the_bits_of_its_modules(tiny_llama, tmp_path, quantization, norm_before_residual,
                                                                monkeypatch):
    """A feed pass of 3 rows and two chain passes of 1, through the midlayer's plan and its modules."""
    from tests.models.test_eagle3 import write_eagle3
    from tpspec.models import eagle3
    from tpspec.models.eagle3 import Eagle3Config, Eagle3LlamaForCausalLM

    cpu_kernels.kernels()
    folder = write_eagle3(str(tmp_path / "eagle"), seed=1, ship_embedding=True, norm_before_residual=norm_before_residual,
                          num_attention_heads=6)  # heads of 16, what the rotary kernel takes
    model = Eagle3LlamaForCausalLM(Eagle3Config.from_folder(folder), ModelArchConfig.from_folder(tiny_llama), None)
    model.load_weights(iterate_weights(folder, show_progress=False))
    pack_cpu_weights(model, quantization)
    caches = [allocate_kv_cache(1, 32 * BLOCK, model.kv_cache_shape, torch.float16)[0] for _ in range(2)]
    outs, module_calls = {}, {}
    midlayer_forward = eagle3.Eagle3DecoderLayer.forward
    calls = []
    monkeypatch.setattr(eagle3.Eagle3DecoderLayer, "forward", lambda self, *a: calls.append(1) or midlayer_forward(self, *a))
    for use_plans, cache in ((True, caches[0]), (False, caches[1])):
        model.use_layer_plans = use_plans
        calls.clear()
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(3, model.config.arch.hidden_size, generator=g)
        outs[use_plans] = []
        with torch.inference_mode():
            for rows, context in ((3, 9), (1, 10), (1, 11)):
                md = AttentionMetadata.build([rows], [context], TABLES[:1], BLOCK, torch.device("cpu"))
                ids = torch.randint(0, 1000, (rows,), generator=g)
                normed, prenorm = model(ids, torch.arange(context - rows, context), hidden, cache, md)
                outs[use_plans] += [normed, prenorm]
                hidden = prenorm[-1:]
        module_calls[use_plans] = len(calls)
    assert model._midlayer_plan and module_calls == {True: 0, False: 3}  # the plan ran every pass, the modules none
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert all(torch.equal(a, b) for a, b in zip(*caches))
