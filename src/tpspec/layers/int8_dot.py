"""Q4_1 and Q8_0 weights (and Q5_0's as Q8_0 groups, Q4_K's as Q4_1 groups with float32 scales, Q6_K's
as Q8_0 groups with a float32 scale per 16 weights) times activations rounded to integers, in 8-bit
integer multiply-adds (``--quantization w4a8`` and ``w4a16``; ``csrc/int8_dot_linear.cpp``, one of
``cpu_kernels``).

Each product rounds its input rows once, per 32 values, to ``activation_bits`` (x ≈ dx·qx with
dx = max |x| / QMAX): 8 bits as llama.cpp does (qx in -127..127), or 15 (qx in -16256..16256, two
bytes a value, twice the integer work). A group's dot product is then dw·dx·Σ q·qx (+ m·dx·Σ qx for
Q4_1's minimum m), the Σ in exact integer multiply-adds (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd
with AVX-512 VNNI; ``isa``), 16 outputs at a time. Unlike ``q4_1``'s float32 widening this rounds
the activations (the accuracy either keeps: benchmarks/dtype_agreement.py), and it runs every row
count through one kernel, with no float16 copy: a row's output does not depend on the rows beside
it, nor on the path (``csrc``'s header).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpspec.layers import cpu_kernels, q4_1, q4_k, q5_0, q6_k, q8_0

GROUP = 32  # values per group: one dw (and m) per weight group, one dx per activation group
BLOCK = 16  # outputs the kernel takes at a time, their weights interleaved
ACTIVATION_QMAX = {8: 127, 15: 127 * 128}  # activation bits -> activations round to -QMAX..QMAX
ISAS = ("avx2", "avx512_vnni")  # the kernel's paths, in its own numbering: same output bits either way
VNNI_ISA = "avx512_vnni"  # the CPU flag vpdpbusd needs (with cpu_kernels.WIDE_ISA)


@dataclass(frozen=True)
class Q4_1Int8Weight:
    """An exactly-Q4_1 (or Q4_K) ``[out_features, in_features]`` weight in this kernel's layout
    (``pack_q4_1``), and the bits its activations are rounded to."""

    out_features: int
    activation_bits: int  # a key of ACTIVATION_QMAX
    qweight: torch.Tensor  # [blocks, groups · 256] uint8: blocks of 16 outputs, interleaved 4 weights at a time
    scales: torch.Tensor  # [blocks, groups, 16] float16 (Q4_K's: float32): d
    mins: torch.Tensor  # [blocks, groups, 16] as scales: m


@dataclass(frozen=True)
class Q8_0Int8Weight:
    """An exactly-Q8_0 ``[out_features, in_features]`` weight in this kernel's layout (``pack_q8_0``),
    and the bits its activations are rounded to."""

    out_features: int
    activation_bits: int  # a key of ACTIVATION_QMAX
    qweight: torch.Tensor  # [blocks, groups · 512] int8: blocks of 16 outputs, interleaved 4 weights at a time
    scales: torch.Tensor  # [blocks, groups, 16] float16: d (Q6_K's: [blocks, groups, 2, 16] float32, per 16 weights)
    qsums: torch.Tensor  # [blocks, groups, 16] int16: Σ q over each group (Q6_K's: as its scales, int16)


@functools.lru_cache(maxsize=1)
def isa() -> str:
    """The kernel's path here: ``avx512_vnni`` where the CPU has AVX-512 with VNNI and no ISA cap
    asks for AVX2 (``cpu_kernels.wide``: ``ATEN_CPU_CAPABILITY=avx2`` gives an AVX2 run), else
    ``avx2``. Both give the same bits."""
    from tpspec.cpu_features import cpu_model_and_isa

    return "avx512_vnni" if cpu_kernels.wide() and VNNI_ISA in cpu_model_and_isa()[1] else "avx2"


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """t [out, ...] padded with zeros to whole blocks: [blocks, 16, ...]."""
    pad = -t.shape[0] % BLOCK
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, BLOCK, *t.shape[1:])


def _interleave(q: torch.Tensor) -> torch.Tensor:
    """q [out, groups, n] -> [blocks, groups, n / 4, 16, 4]: each group's weights 4 at a time, the 16
    outputs of a block side by side."""
    qb = _blocks(q)  # [blocks, 16, groups, n]
    return qb.view(*qb.shape[:3], -1, 4).permute(0, 2, 3, 1, 4)


def _group_params(t: torch.Tensor) -> torch.Tensor:
    """t [out, groups] -> [blocks, groups, 16]."""
    return _blocks(t).transpose(1, 2).contiguous()


def _half_group_params(t: torch.Tensor) -> torch.Tensor:
    """t [out, groups, 2] -> [blocks, groups, 2, 16]."""
    return _blocks(t).permute(0, 2, 3, 1).contiguous()


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, activation_bits: int = 8) -> Q4_1Int8Weight:
    """Q4_1 groups (d, m [out, groups] float16, q [out, groups, 32] uint8 in 0..15) in the kernel's
    layout: per block and group 4 parts of 64 bytes, byte 4j + i of part l holding weight 4l + i
    (low nibble) and 16 + 4l + i (high nibble) of output j."""
    chunks = _interleave(q)  # [blocks, groups, 8, 16, 4]
    parts = chunks[:, :, :4] | (chunks[:, :, 4:] << 4)
    return Q4_1Int8Weight(q.shape[0], activation_bits, parts.reshape(parts.shape[0], -1).contiguous(), _group_params(d),
                          _group_params(m))


def pack_q8_0(d: torch.Tensor, q: torch.Tensor, activation_bits: int = 8) -> Q8_0Int8Weight:
    """Q8_0 groups (d [out, groups] float16, q [out, groups, 32] int8) in the kernel's layout: per
    block and group 8 parts of 64 bytes, byte 4j + i of part c holding weight 4c + i of output j."""
    chunks = _interleave(q)  # [blocks, groups, 8, 16, 4]
    qsums = q.to(torch.int16).sum(-1, dtype=torch.int16)  # |Σ| <= 32 · 127
    return Q8_0Int8Weight(q.shape[0], activation_bits, chunks.reshape(chunks.shape[0], -1).contiguous(), _group_params(d),
                          _group_params(qsums))


def pack_q6_k(d: torch.Tensor, q: torch.Tensor, activation_bits: int = 8) -> Q8_0Int8Weight:
    """Groups of two 16-weight halves (d [out, groups, 2] float32, q [out, groups, 32] int8: weight j
    of a group times d[..., j // 16]) in Q8_0's layout with a float32 scale per half: scales and Σ q
    [blocks, groups, 2, 16]."""
    chunks = _interleave(q)  # [blocks, groups, 8, 16, 4]
    qsums = q.view(*q.shape[:2], 2, GROUP // 2).to(torch.int16).sum(-1, dtype=torch.int16)  # [out, groups, 2]
    return Q8_0Int8Weight(q.shape[0], activation_bits, chunks.reshape(chunks.shape[0], -1).contiguous(),
                          _half_group_params(d), _half_group_params(qsums))


def quantize_exact_q4_1(w: torch.Tensor, activation_bits: int) -> Q4_1Int8Weight | None:
    """``w`` ([out, in] float32) in this kernel's layout if it is exactly Q4_1, else None."""
    groups = q4_1.exact_groups(w)
    return None if groups is None else pack_q4_1(*groups, activation_bits)


def quantize_exact_q8_0(w: torch.Tensor, activation_bits: int) -> Q8_0Int8Weight | None:
    """``w`` ([out, in] float32) in this kernel's layout if it is exactly Q8_0, else None."""
    groups = q8_0.exact_groups(w)
    return None if groups is None else pack_q8_0(*groups, activation_bits)


def quantize_exact_q4_k(w: torch.Tensor, activation_bits: int) -> Q4_1Int8Weight | None:
    """``w`` ([out, in] float32) in the Q4_1 layout with float32 scales and mins if its groups are
    exactly D·q + M with a 4-bit q (Q4_K's: ``q4_k.exact_groups``), else None."""
    groups = q4_k.exact_groups(w)
    return None if groups is None else pack_q4_1(*groups, activation_bits)


def quantize_exact_q6_k(w: torch.Tensor, activation_bits: int) -> Q8_0Int8Weight | None:
    """``w`` ([out, in] float32) in Q8_0's layout with a float32 scale per 16 weights if each 16 are
    exactly S·k with whole numbers |k| ≤ 32 (Q6_K's: ``q6_k.exact_groups``), else None."""
    groups = q6_k.exact_groups(w)
    return None if groups is None else pack_q6_k(*groups, activation_bits)


def quantize_exact_q5_0(w: torch.Tensor, activation_bits: int) -> Q8_0Int8Weight | None:
    """``w`` ([out, in] float32) in the Q8_0 kernel's layout if it is exactly Q5_0 (its groups are
    whole numbers in −16..16 times a float16 d: ``q5_0.exact_groups``), else None."""
    groups = q5_0.exact_groups(w)
    return None if groups is None else pack_q8_0(*groups, activation_bits)


def round_activations(x: torch.Tensor, activation_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 as the kernel rounds it: qx [rows, groups, 32] (whole numbers in
    -QMAX..QMAX, float32) and dx [rows, groups] (the reference of the kernel's tests)."""
    qmax = ACTIVATION_QMAX[activation_bits]
    groups = x.float().view(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))  # as the kernel divides
    return torch.round(groups * scale[..., None]), amax / qmax


def int8_linear(x: torch.Tensor, weight: Q4_1Int8Weight | Q8_0Int8Weight) -> torch.Tensor:
    """x: [num_rows, in_features] -> [num_rows, out_features] in x's dtype: x rounded to the weight's
    activation bits per 32 values times the weight."""
    kernels, path, bits = cpu_kernels.kernels(), ISAS.index(isa()), weight.activation_bits
    # No conversion where none is needed: a no-op .float() / .to() still costs ~1 us a call, and a
    # forward makes 121 of these products.
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    if isinstance(weight, Q4_1Int8Weight):
        out = kernels.q4_1_int8_linear(x32, weight.qweight, weight.scales, weight.mins, weight.out_features, bits, path)
    else:
        out = kernels.q8_0_int8_linear(x32, weight.qweight, weight.scales, weight.qsums, weight.out_features, bits, path)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
