"""Counter-based random numbers keyed by (seed, position, global token id, stream).

Every number is a pure function of its key: no generator state, no dependence on rank, shard
layout, batch composition or device. Computing token ids ``[a, b)`` on one rank and ``[b, c)`` on
another gives exactly the numbers of ``[a, c)`` computed at once, which is what lets a
vocab-parallel sampler reproduce the unsharded one bit for bit.

The hash works on 32-bit lanes held in int64 tensors, so it runs with plain torch integer ops on
any device. Every multiplication is a 32-bit value times a 31-bit odd constant, so every
intermediate stays below 2^63 (no signed overflow). A row key is two independent 32-bit lanes
``(a, b)`` absorbed from the 64-bit seed, the 64-bit position and the stream; an element is
``mix(mix(token_id ^ a) ^ b)``, a bijection of the token id within a row.

``uniform`` is bit-exact across devices (integer ops and exact float conversions only);
``gumbel`` adds an elementwise ``log``, so it is bit-exact for every layout on one device type.
"""

from __future__ import annotations

import torch

# Streams: independent noise for each use of randomness at one (seed, position).
SAMPLE = 0  # Gumbel-max sampling of the emitted token
DRAFT = 1  # probabilistic drafting
ACCEPT = 2  # rejection sampler's acceptance test
RESIDUAL = 3  # rejection sampler's draw from the residual distribution

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D  # odd constants below 2^31: (2^32 - 1) * c < 2^63
_MUL2 = 0x2C1B3C6D
_LANE_A = 0x243F6A88  # distinct starting states of the two row-key lanes
_LANE_B = 0x13198A2E
# u = (k + 0.5) * 2^-23 for a 23-bit k: exact in float32, min 2^-24, max 1 - 2^-24.
_UNIFORM_BITS = 23


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (xorshift-multiply); ``x`` holds values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """In-place ``_mix32`` for the big per-element tensor (same result, fewer allocations)."""
    torch.bitwise_right_shift(x, 16, out=scratch)
    x.bitwise_xor_(scratch).mul_(_MUL1).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch).mul_(_MUL2).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=scratch)
    x.bitwise_xor_(scratch)


def _row_keys(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit lanes per row, each ``[rows, 1]``."""
    words = (
        seeds & _MASK32,
        (seeds >> 32) & _MASK32,
        positions & _MASK32,
        (positions >> 32) & _MASK32,
    )
    lanes = []
    for start in (_LANE_A, _LANE_B):
        h = _mix32(words[0] ^ start)
        for w in words[1:]:
            h = _mix32(h ^ w)
        lanes.append(_mix32(h ^ stream).unsqueeze(-1))
    return lanes[0], lanes[1]


def _check_inputs(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    token_ids: torch.Tensor,  # [vocab_slice] or [rows, n] int64
    stream: int,
) -> None:
    for name, t in (("seeds", seeds), ("positions", positions), ("token_ids", token_ids)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor, got dtype {t.dtype}")
    if seeds.dim() != 1 or positions.shape != seeds.shape:
        raise ValueError(
            f"seeds and positions must both be [rows], got {tuple(seeds.shape)} and "
            f"{tuple(positions.shape)}"
        )
    if token_ids.dim() == 2 and token_ids.shape[0] != seeds.shape[0]:
        raise ValueError(
            f"token_ids [rows, n] must have {seeds.shape[0]} rows, got {tuple(token_ids.shape)}"
        )
    if token_ids.dim() not in (1, 2):
        raise ValueError(
            f"token_ids must be [vocab_slice] or [rows, n], got shape {tuple(token_ids.shape)}"
        )
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream <= _MASK32:
        raise ValueError(f"stream must be an integer in [0, 2^32), got {stream!r}")


def random_bits(
    seeds: torch.Tensor,  # [rows] int64, any value (used modulo 2^64)
    positions: torch.Tensor,  # [rows] int64
    token_ids: torch.Tensor,  # [vocab_slice] or [rows, n] int64, global ids in [0, 2^32)
    stream: int,
) -> torch.Tensor:
    """32 random bits per (row, token id) as int64 values in [0, 2^32): ``[rows, vocab_slice|n]``."""
    _check_inputs(seeds, positions, token_ids, stream)
    a, b = _row_keys(seeds, positions, stream)
    x = (token_ids & _MASK32) ^ a  # broadcasts to [rows, vocab_slice] or [rows, n]
    scratch = torch.empty_like(x)
    _mix32_(x, scratch)
    x.bitwise_xor_(b)
    _mix32_(x, scratch)
    return x


def uniform(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    token_ids: torch.Tensor,  # [vocab_slice] or [rows, n] int64
    stream: int,
) -> torch.Tensor:
    """Uniform float32 in the open interval (0, 1), ``[rows, vocab_slice|n]``.

    Values are ``(k + 0.5) / 2^23`` for a 23-bit integer k, so they lie in [2^-24, 1 - 2^-24].
    """
    k = random_bits(seeds, positions, token_ids, stream) >> (32 - _UNIFORM_BITS)
    return k.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def gumbel(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    token_ids: torch.Tensor,  # [vocab_slice] or [rows, n] int64
    stream: int,
) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` in float32, ``[rows, vocab_slice|n]``.

    ``argmax(logits + gumbel)`` draws from ``softmax(logits)``. The noise is bounded, within
    about [-2.8, 16.6], because u is: a token whose logit trails the best one by more than
    ~19.4 (probability ratio below ~4e-9) is never drawn.
    """
    return uniform(seeds, positions, token_ids, stream).log_().neg_().log_().neg_()
