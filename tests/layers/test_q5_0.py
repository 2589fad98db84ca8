"""Q5_0 weights (layers.q5_0; Gemma 3's GGUF stores most of its layers so): exact recovery of groups
quantized by gguf-py's Q5_0 (llama.cpp's format as the loader reads it), merged weights that mix
Q5_0 and Q8_0 groups, weights left alone, and layers packing them in the Q8_0 kernels' layouts under
every quantization method that has them, their products those of the recovered weight."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from tests.layers.gguf_weights import gguf_round_trip
from tpspec.layers import cpu_kernels, int8_dot, q5_0, q8_0
from tpspec.layers.cpu_weights import pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")


def weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[0, :32] = 0  # an all-zero group
    w[1, :32] = -w[1, :32].abs()  # a group whose value of largest magnitude is negative
    return w


@pytest.mark.parametrize("in_features", [32, 640])
def test_gguf_q5_0_weights_are_recovered(in_features):
    w = gguf_round_trip(weight(40, in_features), gguf.GGMLQuantizationType.Q5_0)
    d, k = q5_0.exact_groups(w)
    assert d.dtype == torch.float16 and d.shape == (40, in_features // 32) and (d >= 0).all()
    assert k.dtype == torch.int8 and k.shape == (40, in_features // 32, 32) and k.abs().max() <= 16
    assert torch.equal((d.float()[..., None] * k).flatten(1), w)
    assert torch.equal(q8_0.dequantize(q5_0.quantize_exact(w)), w)


def test_a_merged_weight_of_q5_0_and_q8_0_rows_is_recovered():
    """Gemma 3's q/k/v in half its layers: q and k Q5_0, v Q8_0, merged into one weight."""
    rows = [gguf_round_trip(weight(32, 640, seed=1), gguf.GGMLQuantizationType.Q5_0),
            gguf_round_trip(weight(16, 640, seed=2), gguf.GGMLQuantizationType.Q8_0)]
    w = torch.cat(rows)
    assert q8_0.quantize_exact(w) is None  # not Q8_0's rounding in the Q5_0 rows
    d, k = q5_0.exact_groups(w)
    assert torch.equal((d.float()[..., None] * k).flatten(1), w)
    assert k[:32].abs().max() <= 16 and k[32:].abs().max() > 16


def test_weights_that_are_not_q5_0_are_left_alone():
    w = gguf_round_trip(weight(8, 64), gguf.GGMLQuantizationType.Q5_0)
    assert q5_0.exact_groups(torch.randn(8, 64)) is None
    assert q5_0.exact_groups(w[:, :48]) is None  # not whole groups
    assert q5_0.exact_groups(w.double()) is None
    off = w.clone()
    off[3, 5] += 1e-4  # one weight off its group's grid
    assert q5_0.exact_groups(off) is None
    q4_1 = gguf_round_trip(weight(8, 256), gguf.GGMLQuantizationType.Q4_1)  # a scale and a minimum a group
    assert q5_0.exact_groups(q4_1) is None


@needs_kernel
@pytest.mark.parametrize("method, fmt, bits", [("q4_1", "q8_0", None), ("w4a8", "q8_0_int8", 8),
                                               ("w4a16", "q8_0_int8", 15), ("w4a16-fp16", "q8_0_int8_fp16", 15)])
def test_layers_pack_q5_0_weights_in_the_q8_0_kernels(method, fmt, bits):
    layers = nn.ModuleList([LinearBase(640, 48, False, torch.float32) for _ in range(2)])
    with torch.no_grad():
        layers[0].weight.copy_(gguf_round_trip(weight(48, 640), gguf.GGMLQuantizationType.Q5_0))
        layers[1].weight.copy_(weight(48, 640, seed=1))
    pack_cpu_weights(layers, method)
    packed = [packed_weight_of(layer.weight) for layer in layers]
    assert [p.format for p in packed] == [fmt, "fp16"]
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(0))
    if bits is None:  # the exact float32 widening: the float32 product
        torch.testing.assert_close(layers[0](x), x @ layers[0].weight.T, rtol=1e-5, atol=1e-5)
    else:  # the integer kernel of the recovered groups
        kernel_weight = packed[0].data[0] if fmt.endswith("_fp16") else packed[0].data
        assert kernel_weight.activation_bits == bits
        d, k = q5_0.exact_groups(layers[0].weight)
        assert torch.equal(layers[0](x), int8_dot.int8_linear(x, int8_dot.pack_q8_0(d, k, bits)))
