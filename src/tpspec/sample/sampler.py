"""Full-vocabulary sampler: greedy argmax or filtered Gumbel-max, plus optional logprobs.

The sampled token is a pure function of (logits, sampling params, seed, position): the noise
comes from ``gumbel.gumbel(seed, position, token_id, SAMPLE)``, never from a global RNG.

Per random row, in order:
  1. ``scaled = logits.float() / temperature`` (a division: a vocab-parallel sampler must do the
     same to match bit for bit);
  2. top-k: keep every token whose scaled logit is >= the k-th largest (ties at the k-th value
     are all kept, so more than k tokens may survive);
  3. top-p, on what top-k kept: sort descending, find the shortest prefix whose cumulative mass
     reaches ``top_p · Z`` (at least one token), and keep every token whose logit is >= the logit
     of the prefix's last token (ties at the boundary are all kept). Masses and Z are the exact
     fixed-point softmax weights of ``sample.mass``, so the nucleus does not depend on how the
     row is summed (a vocab-parallel sampler finds the same one);
  4. min-p: keep tokens with ``p >= min_p * p_max``, evaluated as
     ``scaled >= max(scaled) + log(min_p)`` (ties kept, the maximum always survives);
  5. ``argmax(masked + gumbel)``; an exact tie goes to the lowest token id.
Greedy rows (temperature 0) take ``argmax(logits)``, ties to the lowest token id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tpspec.sample.gumbel import SAMPLE, gumbel
from tpspec.sample.mass import masses, reached
from tpspec.sampling_params import SamplingParams

# Top-p looks for its prefix among this many best tokens, growing to a full sort (see apply_top_p).
_TOP_P_CANDIDATES = (256, 4096, 2**62)
_INT64_MIN = -(2**63)


def to_int64(seed: int) -> int:
    """Any Python int, reduced modulo 2^64 into the int64 range."""
    return (seed - _INT64_MIN) % 2**64 + _INT64_MIN


_METADATA_TENSORS = (
    ("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32), ("min_p", torch.float32),
    ("seeds", torch.int64), ("positions", torch.int64),
)


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [rows] float32, 0 = greedy
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float32, 1 = off
    min_p: torch.Tensor  # [rows] float32, 0 = off
    seeds: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64, position of the token being sampled
    max_num_logprobs: int | None  # None: no logprobs; n >= 0: sampled logprob + top n
    all_greedy: bool
    all_random: bool
    no_top_k_top_p_min_p: bool

    def __post_init__(self) -> None:
        rows = self.temperature.shape
        for name, dtype in _METADATA_TENSORS:
            t = getattr(self, name)
            if t.shape != rows or t.dtype != dtype or len(rows) != 1:
                raise ValueError(
                    f"{name} must be a [rows] {dtype} tensor with rows={tuple(rows)}, "
                    f"got shape {tuple(t.shape)} dtype {t.dtype}"
                )
        if self.max_num_logprobs is not None and self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be None or >= 0, got {self.max_num_logprobs}")

    def select(
        self, rows: torch.Tensor, positions: torch.Tensor | None = None, random_only: bool = False
    ) -> "SamplingMetadata":
        """Rows ``rows`` ([n] int64, repeats allowed) as their own metadata, drawing at
        ``positions`` ([n] int64; default: their own), without logprobs. The batch-wide flags are
        kept (they hold for any subset; a subset of a mixed batch takes the mixed path), unless
        ``random_only`` says every selected row is random (temperature > 0)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, rows)

        return SamplingMetadata(
            temperature=pick(self.temperature), top_k=pick(self.top_k), top_p=pick(self.top_p),
            min_p=pick(self.min_p), seeds=pick(self.seeds),
            positions=pick(self.positions) if positions is None else positions,
            max_num_logprobs=None, all_greedy=self.all_greedy and not random_only,
            all_random=self.all_random or random_only, no_top_k_top_p_min_p=self.no_top_k_top_p_min_p,
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """One row per entry; ``seeds`` are any ints (reduced modulo 2^64)."""
        if not len(params) == len(seeds) == len(positions):
            raise ValueError(
                f"params, seeds and positions must have equal lengths, got "
                f"{len(params)}, {len(seeds)} and {len(positions)}"
            )
        requested = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([to_int64(s) for s in seeds], torch.int64),
            positions=tensor(list(positions), torch.int64),
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(p.is_greedy for p in params),
            all_random=not any(p.is_greedy for p in params),
            no_top_k_top_p_min_p=all(
                p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params
            ),
        )


@dataclass(frozen=True)
class SampledLogprobs:
    """Logprobs of the raw logits (temperature and filters not applied)."""

    token_logprob: torch.Tensor  # [rows] float32, at the sampled token
    topk_logprobs: torch.Tensor  # [rows, n] float32, descending
    topk_token_ids: torch.Tensor  # [rows, n] int64, ties ordered by lowest id


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprobs: SampledLogprobs | None


def apply_top_k(
    logits: torch.Tensor,  # [rows, vocab_size] float32
    top_k: torch.Tensor,  # [rows] int64, 0 = off
) -> torch.Tensor:
    """Mask to -inf every logit below the row's k-th largest (the input is not modified)."""
    vocab = logits.shape[-1]
    k = top_k.clamp(min=0, max=vocab)
    k_max = int(k.max())
    if k_max == 0:
        return logits
    top = torch.topk(logits, k_max, dim=-1).values  # [rows, k_max], descending
    kth = top.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))  # [rows, 1]
    drop = (logits < kth) & (k > 0).unsqueeze(-1)
    return logits.masked_fill(drop, -math.inf)


def top_p_threshold(
    sorted_logits: torch.Tensor,  # [rows, n] float32, descending: each row's best n (or all)
    row_max: torch.Tensor,  # [rows] float32, maximum of the whole row
    total: torch.Tensor,  # [rows] int64, Z: the whole row's mass
    top_p: torch.Tensor,  # [rows] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit of the first token whose cumulative mass reaches top_p · Z ``[rows, 1]``, and
    whether it lies among these n ``[rows]`` bool. Integer cumulative sums: exact at every n."""
    hit = reached(masses(sorted_logits, row_max).cumsum(dim=-1), top_p, total)  # [rows, n], monotone
    index = hit.to(torch.int8).argmax(dim=-1, keepdim=True)  # first hit (0 if none)
    return sorted_logits.gather(-1, index), hit[:, -1]


def apply_top_p(
    logits: torch.Tensor,  # [rows, vocab_size] float32
    top_p: torch.Tensor,  # [rows] float32, 1 = off
) -> torch.Tensor:
    """Mask to -inf every token outside the row's top-p nucleus (the input is not modified).

    The prefix is searched among the best 256 tokens, then 4096, then the whole sorted vocab,
    each stage only for rows not yet resolved; the cumulative masses are integers, so the stage
    that resolves a row does not change its result.
    """
    rows = torch.nonzero(top_p < 1.0).squeeze(-1)
    if rows.numel() == 0:
        return logits
    sub = logits.index_select(0, rows)  # [n_rows, vocab_size]
    row_max = sub.amax(dim=-1)  # [n_rows]
    total = masses(sub, row_max).sum(dim=-1)  # [n_rows] int64
    sub_p = top_p.index_select(0, rows)  # [n_rows]
    vocab = sub.shape[-1]
    threshold = torch.empty(rows.numel(), 1, dtype=sub.dtype, device=sub.device)  # [n_rows, 1]
    pending = torch.arange(rows.numel(), device=logits.device)
    for n in _TOP_P_CANDIDATES:
        part = sub.index_select(0, pending)
        if n >= vocab:
            best = torch.sort(part, dim=-1, descending=True).values
        else:
            best = torch.topk(part, n, dim=-1).values
        thr, found = top_p_threshold(best, row_max[pending], total[pending], sub_p[pending])
        threshold.index_copy_(0, pending, thr)
        if n >= vocab or bool(found.all()):
            break
        pending = pending[~found]
    out = logits.clone()
    out.index_copy_(0, rows, sub.masked_fill(sub < threshold, -math.inf))
    return out


def apply_min_p(
    logits: torch.Tensor,  # [rows, vocab_size] float32
    min_p: torch.Tensor,  # [rows] float32, 0 = off
) -> torch.Tensor:
    """Mask to -inf tokens with ``p < min_p * p_max``, compared in logit space (input not modified)."""
    on = min_p > 0
    if not bool(on.any()):
        return logits
    floor = logits.amax(dim=-1) + torch.log(min_p.clamp(min=1e-30))  # [rows]
    drop = (logits < floor.unsqueeze(-1)) & on.unsqueeze(-1)
    return logits.masked_fill(drop, -math.inf)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,  # [rows, vocab_size] float32, temperature already applied
    top_k: torch.Tensor,  # [rows] int64
    top_p: torch.Tensor,  # [rows] float32
    min_p: torch.Tensor,  # [rows] float32
) -> torch.Tensor:
    """The three filters in the documented order; masked entries are -inf."""
    return apply_min_p(apply_top_p(apply_top_k(logits, top_k), top_p), min_p)


def processed_logits(
    logits: torch.Tensor,  # [rows, vocab_size] float32, every row random (temperature > 0)
    metadata: SamplingMetadata,  # the same rows
) -> torch.Tensor:
    """What a random row draws from: ``logits / temperature``, then top-k, top-p, min-p (masked
    entries -inf). ``softmax`` of it is the row's distribution; ``argmax(it + gumbel)`` a draw.

    The Sampler and the rejection sampler both go through here, so plain sampling and
    speculative verification see the same distribution, bit for bit.
    """
    scaled = logits / metadata.temperature.unsqueeze(-1)
    if not metadata.no_top_k_top_p_min_p:
        scaled = apply_top_k_top_p_min_p(scaled, metadata.top_k, metadata.top_p, metadata.min_p)
    return scaled


def order_key(x: torch.Tensor) -> torch.Tensor:
    """The float32's bit pattern as int64 in [-2^31, 2^31), monotonic in the value (-0.0 = +0.0)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _topk_by_key(
    values: torch.Tensor,  # [rows, vocab_size] float32
    n: int,
) -> torch.Tensor:
    """Ids of the top n, equal values ordered by lowest id: one int64 key per token, no ties.

    The key is the float's order-preserving bit pattern in the high half and the inverted token
    id in the low half.
    """
    ids = torch.arange(values.shape[-1], device=values.device, dtype=torch.int64)
    return torch.topk(order_key(values) * 2**32 + (0xFFFFFFFF - ids), n, dim=-1).indices  # [rows, n]


def top_n(
    values: torch.Tensor,  # [rows, vocab_size] float32
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-n (values, ids), descending, equal values ordered by lowest id, deterministically.

    ``torch.topk`` picks the set unless a tie crosses the n-th place; such rows use the exact
    key. The chosen set is then ordered by (value descending, id ascending).
    """
    _, top_ids = torch.topk(values, n, dim=-1)  # [rows, n]
    if n == 0:
        return values.gather(-1, top_ids), top_ids
    nth = values.gather(-1, top_ids[:, -1:])  # [rows, 1]
    tied = torch.nonzero((values >= nth).sum(dim=-1) > n).squeeze(-1)
    if tied.numel() > 0:
        top_ids = top_ids.index_copy(0, tied, _topk_by_key(values.index_select(0, tied), n))
    top_ids = top_ids.sort(dim=-1).values
    order = values.gather(-1, top_ids).sort(dim=-1, descending=True, stable=True).indices
    top_ids = top_ids.gather(-1, order)
    return values.gather(-1, top_ids), top_ids


def logprobs_of(
    logits: torch.Tensor,  # [rows, vocab_size] float32, raw
    token_ids: torch.Tensor,  # [rows] int64
    n: int,
) -> SampledLogprobs:
    """log softmax(logits) at ``token_ids``, and the top n tokens by logit (the same order as by
    logprob; ties to the lowest id) with their logprobs."""
    all_logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab_size]
    _, top_ids = top_n(logits, min(n, logits.shape[-1]))
    return SampledLogprobs(
        token_logprob=all_logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1),
        topk_logprobs=all_logprobs.gather(-1, top_ids),
        topk_token_ids=top_ids,
    )


def first_max(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, n] -> [rows] int64, each row's first maximum (``torch.argmax``)."""
    return x.argmax(dim=-1)


class Sampler:
    """Samples one token per row from full-vocabulary logits. ``argmax``: how a row's token is
    picked from its (noised) logits, ``torch.argmax``'s answer, [rows, vocab] -> [rows] int64 (the
    model runner hands in ``layers.argmax.argmax_rows``, its CPU kernel, from a layer above this one)."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = first_max):
        self.argmax = argmax

    def __call__(
        self,
        logits: torch.Tensor,  # [rows, vocab_size] float, padding removed
        metadata: SamplingMetadata,
        with_logprobs: bool = True,  # False: no logprobs, whatever metadata.max_num_logprobs says
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(
                f"logits must be [rows, vocab_size] with rows={metadata.temperature.shape[0]}, "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.float()
        if metadata.all_random:
            sampled = self._sample_random(logits, metadata)
        else:
            sampled = self.argmax(logits)  # first maximum: lowest id on ties
            if not metadata.all_greedy:
                rows = torch.nonzero(metadata.temperature > 0).squeeze(-1)
                sub = metadata.select(rows, random_only=True)
                random_ids = self._sample_random(logits.index_select(0, rows), sub)
                sampled = sampled.index_copy(0, rows, random_ids)

        logprobs = None
        if with_logprobs and metadata.max_num_logprobs is not None:
            logprobs = logprobs_of(logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(
        self,
        logits: torch.Tensor,  # [rows, vocab_size] float32, every row random
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        scaled = processed_logits(logits, metadata)
        token_ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
        noise = gumbel(metadata.seeds, metadata.positions, token_ids, SAMPLE)
        return self.argmax(noise.add_(scaled))
