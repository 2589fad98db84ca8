"""Q4_K weights (layers.q4_k; Gemma 3's o projections and half its down projections): exact recovery
of groups dequantized by gguf-py from Q4_K super-blocks (llama.cpp's format as the loader reads it),
weights left alone (Q6_K's among them), and layers packing them in the integer kernels' Q4_1 layout
with float32 scales, their products the recovered groups'."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from tests.layers.gguf_weights import dequantized
from tpspec.layers import cpu_kernels, int8_dot, q4_k
from tpspec.layers.cpu_weights import pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")

@pytest.mark.parametrize("in_features", [256, 1024])
def test_gguf_q4_k_weights_are_recovered(in_features):
    w = dequantized(gguf.GGMLQuantizationType.Q4_K, 40, in_features)
    d, m, q = q4_k.exact_groups(w)
    assert d.dtype == m.dtype == torch.float32 and d.shape == m.shape == (40, in_features // 32) and (d >= 0).all()
    assert q.dtype == torch.uint8 and q.shape == (40, in_features // 32, 32) and q.max() <= 15
    assert torch.equal((d.double()[..., None] * q + m.double()[..., None]).flatten(1), w.double())
    assert not torch.equal(d.half().float(), d)  # not float16 values: Q4_1's own layout could not hold them


def test_a_constant_group_and_a_coarser_grid_are_recovered():
    """A group of one value (D = 0, q = 0, M that value) and one on every other level (a grid of 7 steps
    of 2D fits it as well as 15 of D: the finest that fits is taken, and gives every weight)."""
    w = dequantized(gguf.GGMLQuantizationType.Q4_K, 4, 256)
    w[0, :32] = 0.25
    w[1, :32] = 0.5 - 0.125 * torch.arange(32).remainder(8) * 2  # levels 0, 2, ..., 14 of D = 0.125
    d, m, q = q4_k.exact_groups(w)
    assert d[0, 0] == 0 and m[0, 0] == 0.25 and q[0, 0].eq(0).all()
    assert d[1, 0] == 0.125 and q[1, 0].max() == 14
    assert torch.equal((d.double()[..., None] * q + m.double()[..., None]).flatten(1), w.double())


def test_weights_that_are_not_q4_k_are_left_alone():
    w = dequantized(gguf.GGMLQuantizationType.Q4_K, 8, 256)
    assert q4_k.exact_groups(torch.randn(8, 256)) is None
    assert q4_k.exact_groups(w[:, :48]) is None  # not whole groups
    assert q4_k.exact_groups(w.double()) is None
    off = w.clone()
    off[3, 5] += 1e-4  # one weight off its group's grid
    assert q4_k.exact_groups(off) is None
    assert q4_k.exact_groups(dequantized(gguf.GGMLQuantizationType.Q6_K, 8, 256)) is None  # 64 levels, a scale per 16


@needs_kernel
@pytest.mark.parametrize("method, fmt, bits", [("w4a8", "q4_1_int8", 8), ("w4a16", "q4_1_int8", 15),
                                               ("w4a16-fp16", "q4_1_int8_fp16", 15), ("q4_1", "fp16", None)])
def test_layers_pack_q4_k_weights_in_the_integer_kernels(method, fmt, bits):
    layers = nn.ModuleList([LinearBase(512, 48, False, torch.float32) for _ in range(2)])
    with torch.no_grad():
        layers[0].weight.copy_(dequantized(gguf.GGMLQuantizationType.Q4_K, 48, 512))
        layers[1].weight.normal_()
    pack_cpu_weights(layers, method)
    packed = [packed_weight_of(layer.weight) for layer in layers]
    assert [p.format for p in packed] == [fmt, "fp16"]  # nor Q4_K under "q4_1", whose float kernels have float16 scales
    if bits is None:
        return
    kernel_weight = packed[0].data[0] if fmt.endswith("_fp16") else packed[0].data
    assert kernel_weight.activation_bits == bits and kernel_weight.scales.dtype == torch.float32
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = int8_dot.int8_linear(x, int8_dot.pack_q4_1(*q4_k.exact_groups(layers[0].weight), bits))
    assert torch.equal(layers[0](x), expected)
    exact = x.double() @ layers[0].weight.double().T
    assert ((layers[0](x).double() - exact).norm() / exact.norm()).item() < {8: 1e-2, 15: 1e-4}[bits]  # x's rounding
