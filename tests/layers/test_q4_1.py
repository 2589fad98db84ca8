"""Q4_1 weights kept 4-bit (layers.q4_1): exact recovery from float32, the kernel's layout, and the
kernel against the float32 product, for row counts on both sides of its row blocks and for rows of
an odd number of groups (a tensor-parallel shard's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpspec import cpu_features
from tpspec.layers import cpu_kernels
from tpspec.layers.cpu_weights import QUANTIZED_MAX_ROWS, pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase, RowParallelLinear
from tpspec.spec_decode.drafter_rounding import round_drafter_to_q4_1
from tpspec.layers.q4_1 import GROUP, _pack_nibbles, _unpack_nibbles, dequantize, quantize_exact, round_to_q4_1

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no Q4_1 kernel here: {cpu_kernels.unavailable()}")


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight whose groups are exactly d·q + m, quantized as llama.cpp does (RTN, m = min);
    built here, not by ``round_to_q4_1``, so that the recovery is checked against llama.cpp's rule."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features // GROUP, GROUP, generator=g) * 0.05
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((w - m) / d).clamp(0, 15)
    return (d * q + m).flatten(1)


@pytest.mark.parametrize("in_features", [64, 96, 576])  # 2, 3 (a last unpaired group) and 18 groups
def test_exact_weights_are_recovered(in_features):
    w = q4_1_weight(40, in_features)
    packed = quantize_exact(w)
    assert packed is not None
    assert packed.qweight.shape == (40, in_features // 2) and packed.scales.dtype == torch.float16
    assert torch.equal(dequantize(packed), w)


def test_weights_that_are_not_q4_1_are_left_alone():
    assert quantize_exact(torch.randn(8, 64)) is None  # more than 16 levels a group
    assert quantize_exact(q4_1_weight(8, 64)[:, :48]) is None  # not whole groups
    assert quantize_exact(q4_1_weight(8, 64).double()) is None


def test_nibble_layout_round_trips_and_pairs_groups_by_words():
    q = torch.randint(0, 16, (5, 3, GROUP), dtype=torch.uint8)
    packed = _pack_nibbles(q)
    assert torch.equal(_unpack_nibbles(packed), q)
    word0 = int.from_bytes(bytes(packed[0, :4].tolist()), "little")  # word 0 of the first pair: weights 0, 8, ..., 56
    assert [(word0 >> (4 * k)) & 15 for k in range(8)] == q[0, :2].flatten()[0::8].tolist()
    assert torch.equal(packed[:, 32:] & 15, q[:, 2, :16])  # the unpaired third group: byte j = weights j, j + 16


@needs_kernel
@pytest.mark.parametrize("wide", [False, True], ids=["avx2", "avx512"])
# 3 groups (a pair and a group), 6 (a 4-group block and a pair), 9 (two blocks and a group), 18, 48
@pytest.mark.parametrize("in_features", [96, 192, 288, 576, 1536])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17])
def test_kernel_equals_the_float32_product(rows, in_features, wide):
    if wide and not all(f in cpu_features.cpu_model_and_isa()[1] for f in cpu_kernels.WIDE_ISA):
        pytest.skip("the CPU lacks AVX-512")
    w = quantize_exact(q4_1_weight(72, in_features, seed=rows))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    out = cpu_kernels.kernels().q4_1_linear(x, w.qweight, w.scales, w.mins, wide)
    ref = x.double() @ dequantize(w).double().T
    assert out.shape == (rows, 72) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_the_avx512_path_is_taken_where_the_cpu_has_it_and_no_cap_says_avx2(monkeypatch):
    def wide(flags, cap=None):
        monkeypatch.setattr(cpu_features, "cpu_model_and_isa", lambda: ("cpu", flags))
        if cap is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        cpu_kernels.wide.cache_clear()
        return cpu_kernels.wide()

    try:
        avx512 = ("avx2", "avx512bw", "avx512dq", "avx512f", "avx512vl", "f16c", "fma")
        assert wide(avx512) and wide(avx512, "avx512")
        assert not wide(avx512, "avx2") and not wide(avx512, "default")
        assert not wide(("avx2", "avx512f", "f16c", "fma")) and not wide(("avx2", "f16c", "fma"))
    finally:
        monkeypatch.undo()
        cpu_kernels.wide.cache_clear()


@needs_kernel
def test_layers_pack_exact_weights_as_q4_1_and_the_rest_as_fp16():
    exact, other = LinearBase(96, 64, True, torch.float32), LinearBase(96, 64, False, torch.float32)
    with torch.no_grad():
        exact.weight.copy_(q4_1_weight(64, 96))
        exact.bias.normal_()
        other.weight.normal_()
    pack_cpu_weights(nn.ModuleList([exact, other]), "q4_1")
    assert packed_weight_of(exact.weight).format == "q4_1"
    assert packed_weight_of(other.weight).format == "fp16"
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1):  # the kernel, then fbgemm's float16 GEMM
        x = torch.randn(rows, 96)
        torch.testing.assert_close(exact(x), x @ exact.weight.T + exact.bias, rtol=2e-3, atol=2e-3)
    x = torch.randn(1, 96)
    torch.testing.assert_close(exact(x), x @ exact.weight.T + exact.bias, rtol=1e-5, atol=1e-5)  # exact weights


@needs_kernel
def test_a_drafters_own_weights_are_rounded_to_q4_1_and_packed_so_the_targets_untouched():
    target = LinearBase(96, 64, False, torch.float32)
    own, narrow = LinearBase(96, 64, False, torch.float32), LinearBase(40, 8, False, torch.float32)  # 40: no Q4_1 groups
    row_split = RowParallelLinear(96, 64, False, torch.float32)  # its input is what TP splits: from 0, whole groups
    cut = RowParallelLinear(96, 64, False, torch.float32, input_range=(16, 80))  # a slice that cuts groups
    layers = {"target": target, "own": own, "narrow": narrow, "row_split": row_split, "cut": cut}
    with torch.no_grad():
        for layer in layers.values():
            layer.weight.normal_()
    before = {name: layer.weight.clone() for name, layer in layers.items()}
    drafter = nn.ModuleList([own, narrow, row_split, cut, target])  # the target's layer borrowed by the drafter
    assert round_drafter_to_q4_1(drafter, nn.ModuleList([target])) == 2
    for name in ("target", "narrow", "cut"):
        assert torch.equal(layers[name].weight, before[name]), name
    for name in ("own", "row_split"):
        assert torch.equal(layers[name].weight, round_to_q4_1(before[name])), name
        assert not torch.equal(layers[name].weight, before[name]), name
    pack_cpu_weights(drafter, "q4_1")
    assert [packed_weight_of(layer.weight).format for layer in (own, target)] == ["q4_1", "fp16"]
