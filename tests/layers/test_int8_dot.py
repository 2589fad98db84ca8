"""The integer kernels of ``--quantization w4a8`` and ``w4a16`` (layers.int8_dot): the interleaved
layouts, the activations' rounding to 8 and 15 bits, the products against a float64 reference of the
same rounded numbers for every row count 1-64 and outputs that are not whole blocks, on the AVX2 path
and (where the CPU has it) the AVX-512 VNNI one; a row's output bit-identical alone and among other
rows, and on either path; the distance to the float32 product; the formats these methods pack a
model's weights in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpspec import cpu_features
from tpspec.layers import cpu_kernels, int8_dot
from tpspec.layers.cpu_weights import pack_cpu_weights, packed_weight_of
from tpspec.layers.linear import LinearBase

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")
HAS_VNNI = all(f in cpu_features.cpu_model_and_isa()[1] for f in (*cpu_kernels.WIDE_ISA, int8_dot.VNNI_ISA))
PATHS = [pytest.param("avx2"), pytest.param("avx512_vnni", marks=pytest.mark.skipif(
    not HAS_VNNI, reason="the CPU lacks AVX-512 VNNI"))]


def q4_1_groups(out_features: int, in_features: int, seed: int = 0):
    """Random Q4_1 groups as llama.cpp rounds them (each group's minimum m, its maximum d·15 + m):
    d, m [out, groups] float16 and q [out, groups, 32] uint8."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    d = (torch.rand(out_features, groups, generator=g) * 0.01 + 1e-3).half()
    m = (-torch.rand(out_features, groups, generator=g) * 0.1).half()
    q = torch.randint(0, 16, (out_features, groups, 32), generator=g, dtype=torch.uint8)
    q[..., 0], q[..., 1] = 0, 15
    return d, m, q


def q4_k_groups(out_features: int, in_features: int, seed: int = 0):
    """Random Q4_K groups as the loader gives them: D = d·sc and M = −dmin·m, d and dmin float16, sc
    and m 6-bit (float32 values that are not float16 ones), and q [out, groups, 32] uint8 in 0..15."""
    d, _, q = q4_1_groups(out_features, in_features, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sc, mn = torch.randint(1, 64, (2, *d.shape), generator=g)
    return d.float() * sc, -(d.float() * 0.5).half().float() * mn, q


def q6_k_groups(out_features: int, in_features: int, seed: int = 0):
    """Random Q6_K groups as the loader gives them: a scale per 16 weights, S = d·sc with d float16
    and an 8-bit sc (float32 values that are not float16 ones), d [out, groups, 2] float32, and
    q [out, groups, 32] int8 in -32..31."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(out_features, in_features // 32, 1, generator=g) * 1e-3 + 1e-4).half().float()
    sc = torch.randint(-128, 128, (out_features, in_features // 32, 2), generator=g)
    return d * sc, torch.randint(-32, 32, (out_features, in_features // 32, 32), generator=g, dtype=torch.int8)


def q8_0_groups(out_features: int, in_features: int, seed: int = 0):
    """Random Q8_0 groups: d [out, groups] float16 and q [out, groups, 32] int8 in -127..127."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(out_features, in_features // 32, generator=g) * 0.01 + 1e-3).half()
    return d, torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=g, dtype=torch.int8)


def reference(x: torch.Tensor, bits: int, d, q, m=None) -> torch.Tensor:
    """Σ over groups of dw·dx·Σ q·qx (+ m·dx·Σ qx) in float64, x rounded as the kernel rounds it;
    d [out, groups, 2]: a scale per 16 weights (Q6_K's)."""
    qx, dx = int8_dot.round_activations(x, bits)  # [rows, groups, 32], [rows, groups]
    if d.dim() == 3:
        halves = torch.einsum("rghk,oghk->rogh", qx.double().unflatten(-1, (2, 16)), q.double().unflatten(-1, (2, 16)))
        return ((halves * d.double()[None]).sum(-1) * dx.double()[:, None]).sum(-1)
    dots = torch.einsum("rgk,ogk->rog", qx.double(), q.double())  # exact: integers below 2**53
    out = dots * dx.double()[:, None] * d.double()[None]
    if m is not None:
        out = out + (qx.double().sum(-1) * dx.double())[:, None] * m.double()[None]
    return out.sum(-1)


def run(kind: str, x: torch.Tensor, weight, path: str) -> torch.Tensor:
    k, isa, bits = cpu_kernels.kernels(), int8_dot.ISAS.index(path), weight.activation_bits
    if kind in ("q4_1", "q4_k"):
        return k.q4_1_int8_linear(x, weight.qweight, weight.scales, weight.mins, weight.out_features, bits, isa)
    return k.q8_0_int8_linear(x, weight.qweight, weight.scales, weight.qsums, weight.out_features, bits, isa)


@pytest.mark.parametrize("bits, qmax", [(8, 127), (15, 16256)])
def test_activations_round_per_32_values(bits, qmax):
    x = torch.cat([torch.linspace(-2, 1, 32), torch.zeros(32), torch.full((32,), 0.5)])[None]
    qx, dx = int8_dot.round_activations(x, bits)
    assert qx[0, 0].min() == -qmax and qx[0, 0].max() == round(qmax / 2)
    assert dx[0, 0] == pytest.approx(2 / qmax) and torch.all(qx[0, 1] == 0) and torch.all(qx[0, 2] == qmax)


def test_layouts_interleave_four_weights_of_sixteen_outputs():
    d, m, q = q4_1_groups(20, 64)  # 2 blocks (the second padded), 2 groups
    w = int8_dot.pack_q4_1(d, m, q)
    assert w.qweight.shape == (2, 2 * 256) and w.scales.shape == (2, 2, 16) and w.out_features == 20
    part = w.qweight[1, 256 + 64 * 3 : 256 + 64 * 4]  # block 1, group 1, part 3: weights 12..15 and 28..31
    assert torch.equal(part[4 * 2 : 4 * 3] & 15, q[18, 1, 12:16]) and torch.equal(part[4 * 2 : 4 * 3] >> 4, q[18, 1, 28:32])
    assert torch.all(part[4 * 4 :] == 0) and torch.all(w.scales[1, :, 4:] == 0)  # outputs 20..31: padding
    assert torch.equal(w.mins[0, 1], m[:16, 1])
    d8, q8 = q8_0_groups(16, 32)
    w8 = int8_dot.pack_q8_0(d8, q8)
    assert w8.qweight.shape == (1, 512) and torch.equal(w8.qweight[0, 64 * 5 + 4 * 7 : 64 * 5 + 4 * 8], q8[7, 0, 20:24])
    assert torch.equal(w8.qsums[0, 0], q8[:, 0].sum(-1).to(torch.int16))


def test_exact_weights_are_recovered_and_others_left_alone():
    d, m, q = q4_1_groups(24, 96)
    w = (d.float()[..., None] * q + m.float()[..., None]).flatten(1)
    packed = int8_dot.quantize_exact_q4_1(w, 15)
    assert packed is not None and torch.equal(packed.qweight, int8_dot.pack_q4_1(d, m, q).qweight)
    assert packed.activation_bits == 15 and int8_dot.quantize_exact_q4_1(torch.randn(24, 96), 8) is None
    d8, q8 = q8_0_groups(24, 96)
    q8[:, :, 0] = 127  # llama.cpp's d = max |w| / 127
    w8 = (d8.float()[..., None] * q8).flatten(1)
    assert torch.equal(int8_dot.quantize_exact_q8_0(w8, 8).qweight, int8_dot.pack_q8_0(d8, q8).qweight)
    assert int8_dot.quantize_exact_q8_0(torch.randn(24, 96), 8) is None


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [8, 15])
@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q8_0", "q6_k"])
# 40 outputs: two blocks and a half one; 3 groups, 18 (the default model's width), 9 (a TP 2 shard's)
@pytest.mark.parametrize("out_features, in_features", [(40, 96), (16, 576), (72, 288)])
def test_every_row_count_is_the_reference_and_each_row_its_own(kind, bits, path, out_features, in_features):
    if kind in ("q4_1", "q4_k"):  # Q4_K's: the Q4_1 layout with float32 scales and mins
        d, m, q = (q4_1_groups if kind == "q4_1" else q4_k_groups)(out_features, in_features)
        weight = int8_dot.pack_q4_1(d, m, q, bits)
        assert weight.scales.dtype == weight.mins.dtype == d.dtype
    elif kind == "q6_k":  # Q8_0's layout with a float32 scale per 16 weights
        (d, q), m = q6_k_groups(out_features, in_features), None
        weight = int8_dot.pack_q6_k(d, q, bits)
    else:
        (d, q), m = q8_0_groups(out_features, in_features), None
        weight = int8_dot.pack_q8_0(d, q, bits)
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(1))
    x[3, :32] = -x[3, :32].abs()  # a group whose largest magnitude is negative: h = -127 with 15 bits
    alone = torch.cat([run(kind, x[r : r + 1], weight, path) for r in range(64)])  # [64, out]: each row by itself
    torch.testing.assert_close(alone.double(), reference(x, bits, d, q, m), rtol=1e-5, atol=1e-5)
    for rows in range(1, 65):
        out = run(kind, x[:rows], weight, path)
        assert out.shape == (rows, out_features) and torch.equal(out, alone[:rows]), rows


@needs_kernel
@pytest.mark.skipif(not HAS_VNNI, reason="the CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("bits", [8, 15])
@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q8_0", "q6_k"])
def test_both_paths_give_the_same_bits(kind, bits):
    d, m, q = (q4_k_groups if kind == "q4_k" else q4_1_groups)(48, 576, seed=3)
    weight = (int8_dot.pack_q8_0(*q8_0_groups(48, 576, seed=3), bits) if kind == "q8_0"
              else int8_dot.pack_q6_k(*q6_k_groups(48, 576, seed=3), bits) if kind == "q6_k"
              else int8_dot.pack_q4_1(d, m, q, bits))
    x = torch.randn(37, 576) * 3
    assert torch.equal(run(kind, x, weight, "avx2"), run(kind, x, weight, "avx512_vnni"))


@needs_kernel
@pytest.mark.parametrize("bits, low, high", [(8, 1e-3, 1e-2), (15, 1e-6, 1e-4)])
def test_the_product_is_within_the_activations_rounding_of_float32(bits, low, high):
    d, m, q = q4_1_groups(64, 576, seed=5)
    w = (d.float()[..., None] * q + m.float()[..., None]).flatten(1)
    x = torch.randn(8, 576)
    out = int8_dot.int8_linear(x, int8_dot.pack_q4_1(d, m, q, bits))
    exact = x.double() @ w.double().T
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert low < rel < high  # rounded (not float32's product), by about the activations' bits' worth


def test_the_isa_is_vnni_only_with_avx512_and_avx2_on_request(monkeypatch):
    def isa(flags, cap=None):
        monkeypatch.setattr(cpu_features, "cpu_model_and_isa", lambda: ("cpu", flags))
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        if cap is not None:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        cpu_kernels.wide.cache_clear()
        int8_dot.isa.cache_clear()
        return int8_dot.isa()

    avx512 = ("avx2", "fma", "f16c", *cpu_kernels.WIDE_ISA)
    try:
        assert isa(avx512 + ("avx512_vnni",)) == "avx512_vnni"
        assert isa(avx512 + ("avx512_vnni",), cap="avx2") == "avx2"  # an AVX2 run of the same code
        assert isa(avx512) == "avx2"  # AVX-512 without VNNI: the AVX2 path
        assert isa(("avx2", "fma", "f16c", "avx512_vnni")) == "avx2"
    finally:
        monkeypatch.undo()
        cpu_kernels.wide.cache_clear()
        int8_dot.isa.cache_clear()


@needs_kernel
@pytest.mark.parametrize("method, bits", [("w4a8", 8), ("w4a16", 15)])
def test_integer_methods_pack_exact_weights_in_the_integer_kernels_without_a_float16_copy(method, bits):
    d, m, q = q4_1_groups(40, 96)
    layers = nn.ModuleList([LinearBase(96, 40, False, torch.float32) for _ in range(3)])
    with torch.no_grad():
        layers[0].weight.copy_((d.float()[..., None] * q + m.float()[..., None]).flatten(1))
        d8, q8 = q8_0_groups(40, 96)
        q8[:, :, 0] = -127
        layers[1].weight.copy_((d8.float()[..., None] * q8).flatten(1))
        layers[2].weight.normal_()
    pack_cpu_weights(layers, method)
    formats = [packed_weight_of(layer.weight) for layer in layers]
    assert [p.format for p in formats] == ["q4_1_int8", "q8_0_int8", "fp16"]
    assert isinstance(formats[0].data, int8_dot.Q4_1Int8Weight)  # no (kernel, float16) pair
    assert formats[0].data.activation_bits == formats[1].data.activation_bits == bits
    for rows in (1, 9, 100):  # every row count through the integer kernel
        x = torch.randn(rows, 96)
        assert torch.equal(layers[0](x), int8_dot.int8_linear(x, formats[0].data))
        assert torch.equal(layers[1](x), int8_dot.int8_linear(x, formats[1].data))
    with torch.no_grad():  # changed in place (still exactly Q4_1 and Q8_0, and not): packed again as before
        for layer in layers:
            layer.weight.mul_(2)
    again = [packed_weight_of(layer.weight) for layer in layers]
    assert [p.format for p in again] == ["q4_1_int8", "q8_0_int8", "fp16"]
    assert again[0].data.activation_bits == again[1].data.activation_bits == bits
    x = torch.randn(3, 96)
    assert torch.equal(layers[0](x), int8_dot.int8_linear(x, again[0].data))
    assert torch.equal(layers[0](x), int8_dot.int8_linear(x * 2, formats[0].data))  # x·(2W) = (2x)·W, exactly


@needs_kernel
def test_scales_of_another_shape_are_refused():
    """Q6_K's per-16 scales are [blocks, groups, 2, 16]: the same elements in another order are refused."""
    weight = int8_dot.pack_q6_k(*q6_k_groups(32, 96), 15)
    k, x = cpu_kernels.kernels(), torch.randn(2, 96)
    scales = weight.scales.transpose(1, 2).contiguous()  # [blocks, 2, groups, 16]
    with pytest.raises(RuntimeError, match="scales"):
        k.q8_0_int8_linear(x, weight.qweight, scales, weight.qsums, 32, 15, 0)
    with pytest.raises(RuntimeError, match="scales"):  # float16 in the per-16 shape
        k.q8_0_int8_linear(x, weight.qweight, weight.scales.half(), weight.qsums, 32, 15, 0)
