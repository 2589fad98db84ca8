"""Q4_1 weights kept 4-bit: llama.cpp's format, 32 weights a group, w = d·q + m (q a 4-bit integer, d
and m float16). The default model comes as a Q4_1 GGUF, so its layers' float32 weights are exactly
such groups; ``quantize_exact`` recovers them (None where a weight is not exactly Q4_1: nothing is
re-quantized, nothing lost), and ``q4_1_linear`` multiplies float32 activations by them reading a
quarter of float16's bytes per weight (plus 4 bytes of d and m per 32), through tpspec's AVX2 kernel
(``csrc/q4_1_linear.cpp``, one of ``cpu_kernels``; AVX-512 where the CPU has it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpspec.layers import cpu_kernels
from tpspec.layers.row_chunks import by_row_chunks

GROUP = 32  # weights per group (one d and one m)


@dataclass(frozen=True)
class Q4_1Weight:
    """An ``[out_features, in_features]`` weight in the kernel's layout (``csrc/q4_1_linear.cpp``)."""

    qweight: torch.Tensor  # [out_features, in_features / 2] uint8: the 4-bit q, groups in pairs
    scales: torch.Tensor  # [out_features, in_features / 32] float16: d
    mins: torch.Tensor  # [out_features, in_features / 32] float16: m


def _rounded_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ([out, in], in a multiple of GROUP) rounded per group as llama.cpp quantizes Q4_1: m the
    group's minimum, d = (max − min) / 15 (both float16), q = round((w − m) / d) in 0..15.
    Returns d, m [out, groups] float16 and q [out, groups, 32] float32."""
    out_features, in_features = w.shape
    groups = w.detach().float().view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [out, groups]
    d, m = ((high - low) / 15).half(), low.half()
    step = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round((groups - m.float()[..., None]) / step[..., None]).clamp(0, 15)
    return d, m, q


def round_to_q4_1(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in] float32) rounded to Q4_1 as llama.cpp does: the float32 weight a Q4_1 GGUF of
    it would hold (lossy; benchmarks and tests make Q4_1 weights with it)."""
    d, m, q = _rounded_groups(w)
    return (d.float()[..., None] * q + m.float()[..., None]).flatten(1)


@by_row_chunks
def exact_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w`` ([out, in] float32) as Q4_1 groups if every group is exactly d·q + m with float16 d and m
    and q in 0..15 (``round_to_q4_1`` leaves it unchanged): d, m [out, groups] float16 and
    q [out, groups, 32] uint8; else None."""
    d, m, q = _rounded_groups(w)
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None
    if not torch.equal((d.float()[..., None] * q + m.float()[..., None]).flatten(1), w.detach()):
        return None
    return d.contiguous(), m.contiguous(), q.to(torch.uint8)


def quantize_exact(w: torch.Tensor) -> Q4_1Weight | None:
    """``w`` ([out, in] float32) in the kernel's layout if it is exactly Q4_1 (``exact_groups``), else None."""
    groups = exact_groups(w)
    if groups is None:
        return None
    d, m, q = groups
    return Q4_1Weight(_pack_nibbles(q), d, m)


def dequantize(weight: Q4_1Weight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``weight`` holds (the reference of the kernel's tests)."""
    q = _unpack_nibbles(weight.qweight).float()  # [out, groups, 32]
    return (weight.scales.float()[..., None] * q + weight.mins.float()[..., None]).flatten(1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: [out, groups, 32] uint8 in 0..15 -> [out, groups · 16] uint8 in the kernel's layout."""
    out_features, groups, _ = q.shape
    paired = groups // 2 * 2
    pairs = q[:, :paired].reshape(out_features, paired // 2, 8, 8).to(torch.int64)  # [out, pairs, k, l]: weight 8k + l
    words = sum(pairs[:, :, k] << (4 * k) for k in range(8))  # [out, pairs, 8] 32-bit words
    word_bytes = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8)  # little-endian
    tail = q[:, paired:]  # [out, 0 or 1, 32]
    tail_bytes = tail[..., :16] | (tail[..., 16:] << 4)
    return torch.cat([word_bytes.reshape(out_features, -1), tail_bytes.reshape(out_features, -1)], 1).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_pack_nibbles``: [out, groups · 16] uint8 -> [out, groups, 32] uint8."""
    out_features, groups = packed.shape[0], packed.shape[1] // 16
    paired = groups // 2 * 2
    word_bytes = packed[:, : paired * 16].reshape(out_features, paired // 2, 8, 4).to(torch.int64)
    words = sum(word_bytes[..., b] << (8 * b) for b in range(4))  # [out, pairs, 8]
    pairs = torch.stack([(words >> (4 * k)) & 15 for k in range(8)], 2)  # [out, pairs, k, l]
    tail = packed[:, paired * 16 :].reshape(out_features, groups - paired, 16)
    tail_q = torch.cat([tail & 15, tail >> 4], -1)
    return torch.cat([pairs.reshape(out_features, paired, GROUP).to(torch.uint8), tail_q], 1)


def q4_1_linear(x: torch.Tensor, weight: Q4_1Weight) -> torch.Tensor:
    """x: [num_rows, in_features] -> x · dequantize(weight)ᵀ: [num_rows, out_features] in x's dtype."""
    out = cpu_kernels.kernels().q4_1_linear(x.float().contiguous(), weight.qweight, weight.scales, weight.mins,
                                            cpu_kernels.wide())
    return out.to(x.dtype)
