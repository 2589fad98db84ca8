"""Causal self-attention over a paged KV cache.

The cache of one layer is ``[num_blocks · block_size, kv_heads, head_dim]`` for K and for V;
token t of a sequence lives in slot ``block_table[t // block_size] · block_size + t % block_size``.
A step's tokens are written to their slots first, then each sequence's queries attend over its
gathered keys, padded to the batch's longest context and masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def kv_cache_dtype(model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype K/V are cached in: the model's, except float16 on CPU, cached in float32 since
    it attends in float32 (``Attention``); upcasting each new token once beats upcasting the
    whole context in every layer of every step."""
    if model_dtype == torch.float16 and torch.device(device).type == "cpu":
        return torch.float32
    return model_dtype


def allocate_kv_cache(
    num_layers: int,
    num_slots: int,
    kv_cache_shape: tuple[int, int],  # (kv_heads, head_dim) per slot, a model's ``kv_cache_shape``
    model_dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged KV cache: per layer, zeroed K and V of ``[num_slots, kv_heads, head_dim]`` in
    ``kv_cache_dtype(model_dtype, device)``."""
    shape = (num_slots, *kv_cache_shape)
    dtype = kv_cache_dtype(model_dtype, device)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


@dataclass
class AttentionMetadata:
    """Per-step tensors, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    context_slots: torch.Tensor  # [num_seqs, max_context] slots of every key of each sequence (padded with 0)
    query_index: torch.Tensor  # [num_seqs, max_query] index into the step's tokens (padded with num_tokens)
    query_valid: torch.Tensor  # [num_seqs, max_query] bool
    attn_bias: torch.Tensor  # [num_seqs, 1, 1, max_query, max_context] float32: 0 = attend, -inf = masked
    decode_only: bool  # every sequence feeds exactly one token: no query padding
    _head_rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    def head_rows(self, kv_heads: int, heads: tuple[int, ...]) -> torch.Tensor:
        """Rows of a layer's cache viewed as ``[num_slots · kv_heads, head_dim]`` that hold each
        sequence's keys for the given KV heads, head by head: ``[num_seqs · len(heads) ·
        max_context]`` (built once per step and head list). Gathering them gives ``[num_seqs,
        len(heads), max_context, head_dim]`` contiguous, the layout the matmuls and SDPA read
        without another copy."""
        key = (kv_heads, *heads)
        rows = self._head_rows.get(key)
        if rows is None:
            index = torch.tensor(heads, device=self.context_slots.device)
            rows = (self.context_slots.unsqueeze(1) * kv_heads + index[:, None]).view(-1)
            self._head_rows[key] = rows
        return rows

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        non_causal_tail: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Sequence i feeds ``query_lens[i]`` new tokens that end its first ``context_lens[i]`` tokens.

        ``non_causal_tail[i]`` > 0 lets the last that many queries of sequence i see each other
        in both directions (a parallel draft block); causal everywhere else.
        """
        max_q, max_ctx = max(query_lens), max(context_lens)
        num_tokens = sum(query_lens)
        pos = torch.arange(max_ctx)
        ctx = torch.tensor(context_lens)
        qlen = torch.tensor(query_lens)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)  # [num_seqs, width]
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [num_seqs, max_ctx]
        key_valid = pos[None, :] < ctx[:, None]
        context_slots = torch.where(key_valid, slots, 0)
        qpos_local = torch.arange(max_q)
        query_valid = qpos_local[None, :] < qlen[:, None]  # [num_seqs, max_q]
        starts = torch.cumsum(qlen, 0) - qlen
        query_index = torch.where(query_valid, starts[:, None] + qpos_local[None, :], num_tokens)
        qpos = (ctx - qlen)[:, None] + qpos_local[None, :]  # [num_seqs, max_q] absolute position of each query
        mask = pos[None, None, :] <= qpos[:, :, None]
        if non_causal_tail is not None:
            tail = torch.tensor(non_causal_tail)
            in_tail = pos[None, :] >= (ctx - tail)[:, None]  # keys inside the block
            q_in_tail = qpos >= (ctx - tail)[:, None]
            mask = mask | (in_tail[:, None, :] & q_in_tail[:, :, None])
        mask = mask & key_valid[:, None, :]
        mask = mask | ~query_valid[:, :, None]  # padded queries attend somewhere (result discarded)
        flat_slots = torch.where(query_valid, slots.gather(1, torch.clamp(qpos, max=max_ctx - 1)), -1)
        slot_mapping = flat_slots[query_valid]
        bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        return cls(
            slot_mapping=slot_mapping.to(device),
            context_slots=context_slots.to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            attn_bias=bias[:, None, None].to(device),
            decode_only=max_q == 1,
        )

    @classmethod
    def dummy(
        cls, num_rows: int, query_len: int, block_size: int, device: torch.device, non_causal: bool = False
    ) -> tuple["AttentionMetadata", torch.Tensor]:
        """``num_rows`` tokens as sequences of at most ``query_len`` tokens at positions 0, 1, …, all
        in the first blocks of the cache (for profiling before any request owns a block).
        Returns (metadata, positions [num_rows])."""
        lens = [query_len] * (num_rows // query_len) + ([num_rows % query_len] if num_rows % query_len else [])
        table = list(range(-(-query_len // block_size)))
        md = cls.build(lens, lens, [table] * len(lens), block_size, device, non_causal_tail=lens if non_causal else None)
        return md, torch.cat([torch.arange(n) for n in lens]).to(device)


class Attention(nn.Module):
    """softmax(Q·Kᵀ/√d + mask)·V per head, with this rank's heads and the KV heads they read.

    K/V are gathered head by head, one ``index_select`` each (``AttentionMetadata.head_rows``).
    Decode steps in float32 (float16 attends in float32) go through PyTorch's fused SDPA;
    everything else (prefill, k + 1 speculative queries, bfloat16) through two batched matmuls
    over [seqs, kv_heads, group, queries, keys], which CPUs run fastest in bfloat16.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_head_of_head: torch.Tensor):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # kv_head_of_head [num_heads]: the local KV head each local query head reads. With uniform
        # groups, query heads are viewed as [kv_heads, group] and each KV head is gathered once; an
        # uneven head split (e.g. 9 heads over 2 ranks) gathers K/V per query head instead.
        group = num_heads // num_kv_heads
        uniform_groups = num_heads % num_kv_heads == 0 and torch.equal(kv_head_of_head, torch.arange(num_heads) // group)
        self.gathered_heads = tuple(range(num_kv_heads)) if uniform_groups else tuple(kv_head_of_head.tolist())

    def context_rows(self, md: AttentionMetadata) -> torch.Tensor:
        """[num_seqs · len(gathered_heads) · max_context] rows of the cache that K/V are gathered from."""
        return md.head_rows(self.num_kv_heads, self.gathered_heads)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 × [num_slots, num_kv_heads, head_dim]
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads · head_dim]
        k_cache, v_cache = kv_cache
        # CPU float16 batched matmuls are several times slower than float32's: float16 attends in
        # float32, which its cache is kept in (kv_cache_dtype); otherwise compute = the model's dtype.
        compute = k_cache.dtype
        k_cache.index_copy_(0, md.slot_mapping, k.to(compute))
        v_cache.index_copy_(0, md.slot_mapping, v.to(compute))
        num_seqs, max_ctx = md.context_slots.shape
        d = self.head_dim
        # [seqs, kv_heads, ctx, d]; kv_heads = num_heads if groups are uneven (K/V per query head)
        shape = (num_seqs, len(self.gathered_heads), max_ctx, d)
        rows = self.context_rows(md)
        keys = k_cache.view(-1, d).index_select(0, rows).view(shape)
        values = v_cache.view(-1, d).index_select(0, rows).view(shape)
        q = q.to(compute)
        if md.decode_only and compute == torch.float32:
            return self._decode_sdpa(q, keys, values, md).to(k.dtype)
        if md.decode_only:
            q_pad = q.unsqueeze(1)  # [num_seqs, 1, heads, d]
        else:
            q_pad = torch.cat([q, q.new_zeros(1, self.num_heads, d)])[md.query_index]  # [num_seqs, max_q, heads, d]
        max_q = q_pad.shape[1]
        kv_heads = len(self.gathered_heads)
        group = self.num_heads // kv_heads
        # Query heads of one KV head and their queries share the matmul's row dimension.
        qg = q_pad.view(num_seqs, max_q, kv_heads, group, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(num_seqs, kv_heads, group * max_q, d)  # [seqs, kv, group·q, d]
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # [seqs, kv, group·q, ctx]
        scores = scores.float().mul_(self.scale).view(num_seqs, kv_heads, group, max_q, max_ctx)
        probs = torch.softmax(scores.add_(md.attn_bias), dim=-1).to(compute)
        out = torch.matmul(probs.view(num_seqs, kv_heads, group * max_q, max_ctx), values)  # [seqs, kv, group·q, d]
        out = out.view(num_seqs, kv_heads, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, self.num_heads * d)
        out = out.to(k.dtype)
        return out.view(-1, self.num_heads * d) if md.decode_only else out[md.query_valid]

    def _decode_sdpa(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        keys: torch.Tensor,  # [num_seqs, kv_heads, max_context, head_dim] (kv_heads = num_heads if groups are uneven)
        values: torch.Tensor,  # same
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, num_heads · head_dim]
        """Decode steps in float32 through PyTorch's fused SDPA, faster on CPU than the two
        matmuls (not so in bfloat16); the same result up to float rounding."""
        mask = md.attn_bias[:, 0] if q.shape[0] > 1 else None  # [num_seqs, 1, 1, max_context]; one sequence has no padding
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [num_seqs, num_heads, 1, head_dim]
        return out.view(-1, self.num_heads * self.head_dim)
