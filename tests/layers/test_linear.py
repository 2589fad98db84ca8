"""``layers.cpu_weights.linear``: float16 CPU layers run through their weight packed for fbgemm
(``PackedCPUWeight.packed_weight``), float32 math on the float16 weights; without it (inside
torch.compile) float16 goes through float32 past a few rows, and gives what the native float16
matmul gives up to its last rounding; float32 CPU layers run through their weight reordered for
oneDNN up to ONEDNN_MAX_ROWS rows, padded to a row bucket (so oneDNN's per-shape kernels stay
few), equal to ``F.linear`` up to float32 rounding; both pack again when their weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec.cpu_features import has_fbgemm
from tpspec.layers.cpu_weights import CPU_FLOAT16_MAX_ROWS, ONEDNN_MAX_ROWS, ONEDNN_ROW_BUCKETS, linear
from tpspec.layers.linear import ReplicatedLinear


@pytest.mark.parametrize("rows", [1, CPU_FLOAT16_MAX_ROWS, CPU_FLOAT16_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_float16_linear_matches_float32_math(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).half()
    w = (torch.randn(80, 96, generator=g) * 0.1).half()
    b = torch.randn(80, generator=g).half() if bias else None
    out = linear(x, w, b)
    assert out.dtype == torch.float16 and out.shape == (rows, 80)
    if rows > CPU_FLOAT16_MAX_ROWS:  # the float32 path, exactly
        assert torch.equal(out, F.linear(x.float(), w.float(), None if b is None else b.float()).half())
    else:  # the native float16 kernel, untouched
        assert torch.equal(out, F.linear(x, w, b))
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-3, atol=2e-3)


def test_bfloat16_uses_the_native_kernel():
    x, w = torch.randn(16, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 2, 9, 16, 33, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_layers_run_through_the_reordered_weight(rows, bias, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    layer = ReplicatedLinear(96, 80, bias, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(80, generator=g))
    layer.packed_weight()
    x = torch.randn(rows, 96, generator=g)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or pointwise(x, *a))
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 80)
    if rows <= ONEDNN_MAX_ROWS:  # padded up to the smallest bucket that holds it
        assert calls == [min(b for b in ONEDNN_ROW_BUCKETS if b >= rows)]
    else:
        assert calls == []
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not has_fbgemm(), reason="this torch build has no fbgemm")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float16_layers_run_through_fbgemm_in_float32(rows, bias, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    layer = ReplicatedLinear(96, 80, bias, torch.float16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(80, generator=g))
    packed = layer.packed_weight()
    assert packed is not None and layer.packed_weight() is packed  # packed once
    x = torch.randn(rows, 96, generator=g).half()
    calls = []
    fp16 = torch.ops.quantized.linear_dynamic_fp16
    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic_fp16", lambda x, *a: calls.append(x.dtype) or fp16(x, *a))
    with torch.inference_mode():
        out = layer(x)
    assert calls == [torch.float32] and out.dtype == torch.float16 and out.shape == (rows, 80)
    # float32 math on the float16 weights, rounded once to float16 at the end
    b = None if layer.bias is None else layer.bias.float()
    torch.testing.assert_close(out, F.linear(x.float(), layer.weight.float(), b).half(), rtol=1e-3, atol=1e-3)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    assert layer.packed_weight() is not packed


def test_reordered_weight_follows_the_weight(monkeypatch):
    layer = ReplicatedLinear(32, 16, False, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32))
    x = torch.randn(3, 32)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or pointwise(x, *a))
    first = layer.packed_weight()
    assert calls == list(ONEDNN_ROW_BUCKETS)  # every bucket's kernel built at once
    assert layer.packed_weight() is first  # reordered once
    with torch.no_grad():
        layer.weight.mul_(2.0)  # e.g. weights loaded again
    assert layer.packed_weight() is not first
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert ReplicatedLinear(32, 16, False, torch.bfloat16).packed_weight() is None


def test_a_layers_remembered_packed_weight_follows_new_storage_and_repacking():
    """The layer remembers its weight's packed form between forwards; a new storage (``.data``
    replaced) or a re-pack in another format (``pack_cpu_weights`` after a forward) is followed."""
    from tpspec.layers import q4_1
    from tpspec.layers.cpu_weights import pack_cpu_weights

    layer = ReplicatedLinear(32, 16, False, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(q4_1.round_to_q4_1(torch.randn(16, 32)))
    x = torch.randn(3, 32)
    first = layer.packed_weight()
    assert layer.packed_weight() is first and first.format == "onednn"
    layer.weight.data = q4_1.round_to_q4_1(torch.randn(16, 32))  # a new storage, the same Parameter
    second = layer.packed_weight()
    assert second is not first
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    pack_cpu_weights(layer, "w4a16")  # exactly Q4_1: the integer kernel's format
    assert layer.packed_weight().format == "q4_1_int8"
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-3, atol=1e-3)
