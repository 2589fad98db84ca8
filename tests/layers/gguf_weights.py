"""Weights as the loader gives a GGUF's quantized tensors: quantized and dequantized by gguf-py
(Q5_0, Q8_0, Q4_1), or dequantized from random super-blocks (Q4_K, Q6_K, which gguf-py cannot
quantize): the layers' exact-recovery tests start from these."""

from __future__ import annotations

import gguf
import numpy as np
import torch


def gguf_round_trip(w: torch.Tensor, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """``w`` quantized and dequantized by gguf-py, as a GGUF file of it would load."""
    data = gguf.quants.quantize(w.numpy(), kind)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind))).float().view(w.shape)


SUPER_BLOCK = 256


def dequantized(kind: gguf.GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 ``[out, in]`` weight as gguf-py dequantizes random super-blocks of ``kind`` (Q4_K,
    Q6_K): random quants, scales and mins; its float16 super-block scale(s) set to small values."""
    block_bytes = {gguf.GGMLQuantizationType.Q4_K: 144, gguf.GGMLQuantizationType.Q6_K: 210}[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // SUPER_BLOCK, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, (out_features, in_features // SUPER_BLOCK, 2)).astype(np.float16)
    if kind == gguf.GGMLQuantizationType.Q4_K:  # d and dmin lead the block
        blocks[..., :4] = scales.view(np.uint8)
    else:  # d ends it
        blocks[..., -2:] = scales[..., :1].view(np.uint8)
    w = gguf.quants.dequantize(blocks.reshape(out_features, -1), kind)
    return torch.from_numpy(np.ascontiguousarray(w)).float()
