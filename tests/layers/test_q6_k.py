"""Q6_K weights (layers.q6_k; Gemma 3's down projections in half its layers): exact recovery of
weights dequantized by gguf-py from Q6_K super-blocks (llama.cpp's format as the loader reads it),
weights left alone, and layers packing them in the integer kernels' Q8_0 layout with a float32 scale
per 16 weights, their products the recovered groups'."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from tests.layers.gguf_weights import dequantized
from tpspec.layers import cpu_kernels, int8_dot, q6_k
from tpspec.layers.cpu_weights import pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")
Q6_K = gguf.GGMLQuantizationType.Q6_K


@pytest.mark.parametrize("in_features", [256, 2048])
def test_gguf_q6_k_weights_are_recovered(in_features):
    w = dequantized(Q6_K, 40, in_features)
    d, k = q6_k.exact_groups(w)
    assert d.dtype == torch.float32 and d.shape == (40, in_features // 32, 2) and (d >= 0).all()
    assert k.dtype == torch.int8 and k.shape == (40, in_features // 32, 32) and k.abs().max() <= 32
    assert torch.equal((d.double().repeat_interleave(16, -1) * k).flatten(1), w.double())
    assert not torch.equal(d.half().float(), d)  # not float16 values


def test_an_all_zero_half_is_recovered():
    w = dequantized(Q6_K, 4, 256)
    w[2, 16:32] = 0  # the second half of a group
    d, k = q6_k.exact_groups(w)
    assert d[2, 0, 1] == 0 and k[2, 0, 16:].eq(0).all() and d[2, 0, 0] > 0
    assert torch.equal((d.double().repeat_interleave(16, -1) * k).flatten(1), w.double())


def test_weights_that_are_not_q6_k_are_left_alone():
    w = dequantized(Q6_K, 8, 256)
    assert q6_k.exact_groups(torch.randn(8, 256)) is None
    assert q6_k.exact_groups(w[:, :48]) is None  # not whole groups
    assert q6_k.exact_groups(w.double()) is None
    off = w.clone()
    off[3, 5] += 1e-4  # one weight off its half's grid
    assert q6_k.exact_groups(off) is None
    assert q6_k.exact_groups(dequantized(gguf.GGMLQuantizationType.Q4_K, 8, 256)) is None  # offsets: not S·k


@needs_kernel
@pytest.mark.parametrize("method, fmt, bits", [("w4a8", "q8_0_int8", 8), ("w4a16", "q8_0_int8", 15),
                                               ("w4a16-fp16", "q8_0_int8_fp16", 15), ("q4_1", "fp16", None)])
def test_layers_pack_q6_k_weights_in_the_integer_kernels(method, fmt, bits):
    layers = nn.ModuleList([LinearBase(512, 48, False, torch.float32) for _ in range(2)])
    with torch.no_grad():
        layers[0].weight.copy_(dequantized(Q6_K, 48, 512))
        layers[1].weight.normal_()
    pack_cpu_weights(layers, method)
    packed = [packed_weight_of(layer.weight) for layer in layers]
    assert [p.format for p in packed] == [fmt, "fp16"]  # nor Q6_K under "q4_1", whose float kernels have float16 scales
    if bits is None:
        return
    kernel_weight = packed[0].data[0] if fmt.endswith("_fp16") else packed[0].data
    assert kernel_weight.activation_bits == bits and kernel_weight.scales.shape[-2:] == (2, 16)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layers[0](x), int8_dot.int8_linear(x, int8_dot.pack_q6_k(*q6_k.exact_groups(layers[0].weight), bits)))
    exact = x.double() @ layers[0].weight.double().T
    assert ((layers[0](x).double() - exact).norm() / exact.norm()).item() < {8: 1e-2, 15: 1e-4}[bits]  # x's rounding
