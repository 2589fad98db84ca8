"""Q8_0 weights kept 8-bit (layers.q8_0): exact recovery from float32 as llama.cpp rounds, the kernel
against the float32 product on both of its paths, and layers packing such weights (the default
model's tied LM head) under quantization="q4_1"."""

from __future__ import annotations

import pytest
import torch

from tpspec import cpu_features
from tpspec.layers import cpu_kernels
from tpspec.layers.cpu_weights import QUANTIZED_MAX_ROWS, pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase
from tpspec.layers.q8_0 import GROUP, dequantize, quantize_exact

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no Q8_0 kernel here: {cpu_kernels.unavailable()}")


def q8_0_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight whose groups are exactly d·q, rounded as llama.cpp's quantize_row_q8_0 does
    (d = amax / 127 stored as float16, q = round(w / d)), with an all-zero group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features // GROUP, GROUP, generator=g) * 0.05
    w[0, 0] = 0
    d = w.abs().amax(-1, keepdim=True) / 127
    q = torch.round(w / torch.where(d == 0, torch.ones_like(d), d))
    return (d.half().float() * q).flatten(1)


@pytest.mark.parametrize("in_features", [32, 576])
def test_exact_weights_are_recovered(in_features):
    w = q8_0_weight(40, in_features)
    packed = quantize_exact(w)
    assert packed is not None
    assert packed.qweight.shape == (40, in_features) and packed.qweight.dtype == torch.int8
    assert packed.scales.shape == (40, in_features // GROUP) and packed.scales.dtype == torch.float16
    assert torch.equal(dequantize(packed), w)


def test_weights_that_are_not_q8_0_are_left_alone():
    assert quantize_exact(torch.randn(8, 64)) is None
    assert quantize_exact(q8_0_weight(8, 64)[:, :48]) is None  # not whole groups
    assert quantize_exact(q8_0_weight(8, 64).double()) is None
    w = q8_0_weight(8, 64)
    w[3, 5] += 1e-4  # one weight off its group's grid
    assert quantize_exact(w) is None


@needs_kernel
@pytest.mark.parametrize("wide", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("in_features", [32, 96, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17])
def test_kernel_equals_the_float32_product(rows, in_features, wide):
    if wide and not all(f in cpu_features.cpu_model_and_isa()[1] for f in cpu_kernels.WIDE_ISA):
        pytest.skip("the CPU lacks AVX-512")
    w = quantize_exact(q8_0_weight(72, in_features, seed=rows))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    out = cpu_kernels.kernels().q8_0_linear(x, w.qweight, w.scales, wide)
    ref = x.double() @ dequantize(w).double().T
    assert out.shape == (rows, 72) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_layers_pack_exact_q8_0_weights_under_q4_1_quantization():
    layer = LinearBase(96, 64, False, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(q8_0_weight(64, 96))
    pack_cpu_weights(layer, "q4_1")
    assert packed_weight_of(layer.weight).format == "q8_0"
    assert packed_weight_of(layer.weight, "q4_1").format == "q8_0"  # asked again: the same packing
    x = torch.randn(1, 96)
    torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)  # the kernel: exact weights
    x = torch.randn(QUANTIZED_MAX_ROWS + 1, 96)  # fbgemm's float16 GEMM: the weights rounded to float16
    torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=2e-3, atol=2e-3)
