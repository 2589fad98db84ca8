"""Causal self-attention over a paged KV cache.

The cache of one layer is ``[num_blocks · block_size, kv_heads, head_dim]`` for K and for V;
token t of a sequence lives in slot ``block_table[t // block_size] · block_size + t % block_size``.
A step's tokens are written to their slots first, then each sequence's queries attend over its
gathered keys, padded to the batch's longest context and masked. Sequences with queries of one
length class (``query_length_class``: decodes, 2–8, 9–16, 17–32, … queries) attend in one call with
their queries padded to the class's longest, so one long query (a prefill chunk, a long draft
block) does not pad every other sequence of the step to its length. A sliding-window layer
(Gemma 3's local layers) masks, in the same gathered context, the keys a query's window has left
behind (``QueryGroup.window_bias``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tpspec.config import EngineConfig
from tpspec.layers import cpu_kernels


def kv_cache_dtype(requested: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype K/V are cached in (``CacheConfig.kv_cache_dtype``). "auto": float16 on CPU for a
    float32 or float16 model where tpspec's CPU kernels are built, whose attention widens each cached
    value exactly to float32 (half the bytes of a float32 cache: attention 1.1-1.6x faster, most
    where it reads many keys, twice the tokens a cache holds; benchmarks/README.md); elsewhere the model's,
    except float16 on CPU, cached in float32 since PyTorch's path attends in float32 (upcasting each
    new token once beats upcasting the whole context in every layer of every step)."""
    if requested != "auto":
        return getattr(torch, requested)
    cpu = torch.device(device).type == "cpu"
    if cpu and model_dtype in (torch.float32, torch.float16) and cpu_kernels.unavailable() is None:
        return torch.float16
    if model_dtype == torch.float16 and cpu:
        return torch.float32
    return model_dtype


def num_kv_blocks(config: EngineConfig, device: torch.device) -> int:
    """Blocks that fit the KV budget, computed from the whole model so every rank agrees."""
    if config.cache.num_gpu_blocks is not None:
        return config.cache.num_gpu_blocks
    a = config.arch
    elem = kv_cache_dtype(config.cache.kv_cache_dtype, getattr(torch, config.dtype), device).itemsize
    per_block = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * config.cache.block_size * elem
    return max(1, int(config.cache.kv_cache_memory_gb * (1 << 30)) // per_block)


def allocate_kv_cache(
    num_layers: int,
    num_slots: int,
    kv_cache_shape: tuple[int, int],  # (kv_heads, head_dim) per slot, a model's ``kv_cache_shape``
    dtype: torch.dtype,  # the cache's, ``kv_cache_dtype(...)``
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A paged KV cache: per layer, zeroed K and V of ``[num_slots, kv_heads, head_dim]``."""
    shape = (num_slots, *kv_cache_shape)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


# Up to this many queries per sequence, attention reads the keys in about the time of one query
# (it is bound by reading them), so such sequences share one call.
SMALL_QUERY_CLASS = 8


def query_length_class(query_len: int) -> int:
    """Sequences of one class attend in one call, their queries padded to the longest: 1 (decodes),
    2 … SMALL_QUERY_CLASS, then each next power of two (padding at most doubles the queries)."""
    if query_len <= 1:
        return 1
    return max(SMALL_QUERY_CLASS, 1 << (query_len - 1).bit_length())


@dataclass
class QueryGroup:
    """Sequences ``seq_start … seq_end − 1`` of a step, in ``AttentionMetadata`` order, of one
    ``query_length_class``: attention runs once per group with queries padded to the group's
    longest, so a prefill chunk or a long draft block pads only the sequences of its own class."""

    seq_start: int
    seq_end: int
    query_index: torch.Tensor  # [seqs, max_query] index into the step's tokens (padded with num_tokens)
    query_valid: torch.Tensor  # [seqs, max_query] bool
    token_rows: torch.Tensor  # [valid queries] the step's token index of each valid query, row-major
    attn_bias: torch.Tensor  # [seqs, 1, 1, max_query, max_context] float32: 0 = attend, -inf = masked
    query_pos: torch.Tensor  # [seqs, max_query] absolute position of each query (padding included)
    _window_bias: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def decode(self) -> bool:
        return self.query_index.shape[1] == 1

    def window_bias(self, window: int) -> torch.Tensor:
        """``attn_bias`` for a sliding-window layer: a query at position p also no longer sees the
        keys at positions <= p − window (Hugging Face's ``sliding_window``); padded queries keep
        theirs. Built once per step and window."""
        bias = self._window_bias.get(window)
        if bias is None:
            max_ctx = self.attn_bias.shape[-1]
            key_pos = torch.arange(max_ctx, device=self.query_pos.device)
            outside = key_pos[None, None, :] <= self.query_pos[:, :, None] - window  # [seqs, max_q, max_ctx]
            outside &= self.query_valid[:, :, None]
            bias = self.attn_bias.masked_fill(outside[:, None, None], float("-inf"))
            self._window_bias[window] = bias
        return bias


@dataclass
class _GroupPlan:
    """What ``AttentionMetadata.groups`` are built from (NumPy, per sequence in the step's order
    unless said): the step's query and context lengths, non-causal tails, first tokens, the
    ``context_slots`` order of the sequences, their classes in that order, and which keys exist
    ([num_seqs, max_context], in that order)."""

    qlen: np.ndarray
    ctx: np.ndarray
    tail: np.ndarray
    starts: np.ndarray
    order: np.ndarray
    ordered_classes: list[int]
    key_valid: np.ndarray
    device: torch.device

    def build(self) -> tuple[list[QueryGroup], torch.Tensor | None]:
        """The groups, and where each token's output is in their outputs concatenated (None: in token order)."""
        num_seqs, max_ctx = self.key_valid.shape
        num_tokens = int(self.qlen.sum())
        qlen, ctx, tail, starts = (torch.from_numpy(a) for a in (self.qlen, self.ctx, self.tail, self.starts))
        order, key_valid, device = torch.from_numpy(self.order), torch.from_numpy(self.key_valid), self.device
        pos = torch.arange(max_ctx)
        groups = []
        first = 0
        while first < num_seqs:
            last = first
            while last < num_seqs and self.ordered_classes[last] == self.ordered_classes[first]:
                last += 1
            members = order[first:last]
            g_qlen, g_ctx, g_tail = qlen[members], ctx[members], tail[members]
            max_q = int(g_qlen.max())
            qpos_local = torch.arange(max_q)
            query_valid = qpos_local[None, :] < g_qlen[:, None]  # [seqs, max_q]
            query_index = torch.where(query_valid, starts[members][:, None] + qpos_local[None, :], num_tokens)
            qpos = (g_ctx - g_qlen)[:, None] + qpos_local[None, :]  # [seqs, max_q] absolute position of each query
            mask = pos[None, None, :] <= qpos[:, :, None]  # [seqs, max_q, max_ctx]
            block_start = (g_ctx - g_tail)[:, None]
            mask = mask | ((pos[None, :] >= block_start)[:, None, :] & (qpos >= block_start)[:, :, None])
            mask = mask & key_valid[first:last, None, :]
            mask = mask | ~query_valid[:, :, None]  # padded queries attend somewhere (result discarded)
            bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
            groups.append(QueryGroup(
                first, last, query_index.to(device), query_valid.to(device), query_index[query_valid].to(device),
                bias[:, None, None].to(device), qpos.to(device),
            ))
            first = last
        output_order = None
        if len(groups) > 1:
            rows = torch.cat([g.token_rows.cpu() for g in groups])  # [num_tokens] token of each concatenated output
            output_order = torch.empty_like(rows)
            output_order[rows] = torch.arange(num_tokens)
            output_order = output_order.to(device)
        return groups, output_order


@dataclass
class AttentionMetadata:
    """Per-step tensors, built once by the model runner and shared by every layer. Sequences are
    kept grouped by ``query_length_class`` (stable within a class): ``context_slots`` row s is
    the s-th sequence in that order. The per-group tensors of PyTorch's path (``groups``,
    ``output_order``) are built on first use: a step the CPU kernel attends alone never builds them."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token, in the step's token order
    context_slots: torch.Tensor  # [num_seqs, max_context] slots of every key of each sequence (padded with 0)
    decode_only: bool  # every sequence feeds exactly one token: one group, no query padding
    # For the CPU kernel (paged_attention), which reads each query's keys in the cache in place:
    token_seq: torch.Tensor  # [num_tokens] the row of context_slots of each token's sequence
    token_pos: torch.Tensor  # [num_tokens] absolute position of each token
    key_end: torch.Tensor  # [num_tokens] how many of its sequence's first keys each token sees
    # [num_tokens] the first key each token may see (its sequence's ``first_keys``); None: key 0
    key_first: torch.Tensor | None = None
    # (first slot, max_context) when the step has one sequence and its keys fill consecutive slots
    # (consecutive blocks): attention reads them in place instead of gathering them; None otherwise
    contiguous_slots: tuple[int, int] | None = None
    _group_plan: "_GroupPlan | None" = field(default=None, repr=False)
    _groups: tuple[list[QueryGroup], torch.Tensor | None] | None = field(default=None, repr=False)
    _head_rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _key_ranges: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def groups(self) -> list[QueryGroup]:
        """The step's ``QueryGroup``s, in ``context_slots`` order."""
        return self._query_groups()[0]

    @property
    def output_order(self) -> torch.Tensor | None:
        """[num_tokens] where each token's output is in the groups' outputs concatenated; None: in token order."""
        return self._query_groups()[1]

    def _query_groups(self) -> tuple[list[QueryGroup], torch.Tensor | None]:
        if self._groups is None:
            self._groups = self._group_plan.build()
        return self._groups

    def key_range(self, window: int | None) -> torch.Tensor:
        """[num_tokens, 2] int64: the first and one-past-last key of its sequence each token attends
        to, for a layer with that sliding window (None: every earlier key); built once per step and window."""
        ranges = self._key_ranges.get(window)
        if ranges is None:
            first = torch.zeros_like(self.key_end) if window is None else (self.token_pos - window + 1).clamp_(min=0)
            if self.key_first is not None:
                first = torch.maximum(first, self.key_first)
            ranges = torch.stack([first, self.key_end], dim=1)
            self._key_ranges[window] = ranges
        return ranges

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
        first_keys: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Sequence i feeds ``query_lens[i]`` new tokens that end its first ``context_lens[i]`` tokens.

        ``non_causal_tail[i]`` > 0 lets the last that many queries of sequence i see each other
        in both directions (a parallel draft block); causal everywhere else. ``first_keys[i]``:
        sequence i's keys before this position are not seen (a drafter whose KV is written from
        there on; at most its first new token's position). Index arithmetic in NumPy (a step's
        worth of small arrays: a tenth of the time of as many torch ops).
        """
        num_seqs, max_ctx = len(query_lens), max(context_lens)
        num_tokens = sum(query_lens)
        qlen = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        tail = np.asarray(non_causal_tail, dtype=np.int64) if non_causal_tail is not None else np.zeros(num_seqs, np.int64)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((num_seqs, width), dtype=np.int64)  # [num_seqs, width]
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        # The new tokens' slots, in token order.
        decode_only = max(query_lens) == 1 and num_tokens == num_seqs  # one query a sequence
        if decode_only:  # a decode step or a chain pass: the sequences' order is the tokens'
            token_seq, starts = np.arange(num_seqs), np.arange(num_seqs)
            order = starts
            token_pos = ctx - 1
            classes = [query_length_class(1)] * num_seqs
        else:
            token_seq = np.repeat(np.arange(num_seqs), qlen)  # [num_tokens]
            starts = np.cumsum(qlen) - qlen  # [num_seqs] first token of each sequence
            token_pos = (ctx - qlen)[token_seq] + np.arange(num_tokens) - starts[token_seq]
            classes = [query_length_class(n) for n in query_lens]
            order = np.asarray(sorted(range(num_seqs), key=classes.__getitem__), dtype=np.int64)  # stable within a class
        slot_mapping = tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size
        pos = np.arange(max_ctx)
        ordered_tables, ordered_ctx = (tables, ctx) if decode_only else (tables[order], ctx[order])
        # [num_seqs, max_ctx] every block's slots in table order (broadcast, not gathered by position)
        slots = (ordered_tables[:, :, None] * block_size + np.arange(block_size)).reshape(num_seqs, -1)[:, :max_ctx]
        key_valid = pos[None, :] < ordered_ctx[:, None]
        first = None
        if first_keys is not None and any(first_keys):
            first = np.asarray(first_keys, dtype=np.int64)
            if (first > ctx - qlen).any() or (first < 0).any():
                raise ValueError(f"first_keys {first_keys} must lie in [0, each sequence's first new position]")
            key_valid &= pos[None, :] >= first[order][:, None]
        context_slots = np.where(key_valid, slots, 0)
        # Per token: its sequence's row of context_slots and the keys it sees (causal; a
        # non-causal tail sees the whole block).
        if decode_only:  # a lone query sees every key up to its own, a non-causal tail or not
            row_of_seq, key_end = token_seq, ctx + 0
        else:
            row_of_seq = np.empty(num_seqs, dtype=np.int64)
            row_of_seq[order] = np.arange(num_seqs)
            key_end = np.where(token_pos >= (ctx - tail)[token_seq], ctx[token_seq], token_pos + 1)
        contiguous = None
        if num_seqs == 1 and first is None:
            table = block_tables[0][: -(-max_ctx // block_size)]
            if table == list(range(table[0], table[0] + len(table))):
                contiguous = (table[0] * block_size, max_ctx)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return cls(
            slot_mapping=tensor(slot_mapping),
            context_slots=tensor(context_slots),
            decode_only=decode_only,
            token_seq=tensor(row_of_seq if decode_only else row_of_seq[token_seq]),
            token_pos=tensor(token_pos),
            key_end=tensor(key_end),
            key_first=None if first is None else tensor(first[token_seq]),
            contiguous_slots=contiguous,
            _group_plan=_GroupPlan(qlen, ctx, tail, starts, order, classes if decode_only else [classes[i] for i in order],
                                   key_valid, device),
        )

    @classmethod
    def dummy(
        cls, num_rows: int, query_len: int, block_size: int, device: torch.device, non_causal: bool = False,
        context: int = 0,
    ) -> tuple["AttentionMetadata", torch.Tensor]:
        """``num_rows`` tokens as sequences of at most ``query_len`` tokens after ``context`` earlier
        ones (positions context, context + 1, …), all in the first blocks of the cache (for
        profiling before any request owns a block). Returns (metadata, positions [num_rows])."""
        lens = [query_len] * (num_rows // query_len) + ([num_rows % query_len] if num_rows % query_len else [])
        table = list(range(-(-(context + query_len) // block_size)))
        md = cls.build(lens, [context + n for n in lens], [table] * len(lens), block_size, device,
                       non_causal_tail=lens if non_causal else None)
        return md, torch.cat([torch.arange(context, context + n) for n in lens]).to(device)


class Attention(nn.Module):
    """softmax(Q·Kᵀ/√d + mask)·V per head, with this rank's heads and the KV heads they read.

    Float32 steps on CPU (decodes, k + 1 verification queries, draft blocks, prefill chunks), their
    cache float32 or float16 (each value widened exactly as it is read), go through ``cpu_kernels``'
    paged_attention where it is loaded: every query reads its own key range
    (``AttentionMetadata.key_range``) where the keys lie in the paged cache, no gather, no mask
    (2-3x PyTorch's path at one sequence, 1.4-2.8x on 512-token prefill chunks, down to 0.6x on
    64-query chunks over 2,048 keys: benchmarks/README.md). A query's output then depends on its
    own keys alone, not on the step's other queries (``EngineConfig.batch_invariant``). Otherwise
    K/V are gathered head by head, one ``index_select`` each (``AttentionMetadata.head_rows``), except for a lone sequence in
    consecutive slots, read in place (``contiguous_slots``). Per ``QueryGroup``: decodes in float32
    (float16 attends in float32) go through PyTorch's fused SDPA; everything else (prefill, k + 1
    speculative queries, bfloat16) through two batched matmuls over [seqs, kv_heads, group,
    queries, keys], which CPUs run fastest in bfloat16.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, kv_head_of_head: torch.Tensor,
        scale: float | None = None, sliding_window: int | None = None,
    ):
        """``scale``: of the scores (default 1/√head_dim); ``sliding_window``: a query at position p
        sees the keys at positions p − sliding_window + 1 … p only (None: every earlier key)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # kv_head_of_head [num_heads]: the local KV head each local query head reads. With uniform
        # groups, query heads are viewed as [kv_heads, group] and each KV head is gathered once; an
        # uneven head split (e.g. 9 heads over 2 ranks) gathers K/V per query head instead.
        group = num_heads // num_kv_heads
        self.uniform_groups = num_heads % num_kv_heads == 0 and torch.equal(
            kv_head_of_head, torch.arange(num_heads) // group)
        self.gathered_heads = tuple(range(num_kv_heads)) if self.uniform_groups else tuple(kv_head_of_head.tolist())
        self.register_buffer("kv_head_of_head", kv_head_of_head.to(torch.int64).clone(), persistent=False)  # [num_heads]

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
        cache = k_cache.dtype
        # CPU float16 batched matmuls are several times slower than float32's: a float16 cache on CPU
        # attends in float32 (widened in the kernel, or after the gather); otherwise the wider of the
        # queries' and the cache's dtype.
        compute = torch.float32 if cache == torch.float16 and k_cache.is_cpu else torch.promote_types(q.dtype, cache)
        num_seqs, max_ctx = md.context_slots.shape
        d = self.head_dim
        kernels = None
        if compute == torch.float32 and cache in (torch.float32, torch.float16) and d % 8 == 0:
            q = q.to(compute)  # a float16 model's queries widened
            kernels = cpu_kernels.usable(q, k_cache if cache == torch.float32 else None)
        if kernels is not None and k.dtype == torch.float32:  # one call, rounded as .to(cache) rounds
            kernels.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        else:
            k_cache.index_copy_(0, md.slot_mapping, k.to(cache))
            v_cache.index_copy_(0, md.slot_mapping, v.to(cache))
        if kernels is not None:  # the cache read in place (a float16 one widened as read), no gather
            out = kernels.paged_attention(q.contiguous(), k_cache, v_cache, md.context_slots, md.token_seq,
                                          md.key_range(self.sliding_window), self.kv_head_of_head, self.scale,
                                          cpu_kernels.wide())
            return out.to(k.dtype)
        # [seqs, kv_heads, ctx, d]; kv_heads = num_heads if groups are uneven (K/V per query head)
        if md.contiguous_slots is not None and self.uniform_groups and not torch.compiler.is_compiling():
            # One sequence in consecutive slots: its keys in place, strided (a graph keeps the gather)
            start, length = md.contiguous_slots
            keys = k_cache[start : start + length].permute(1, 0, 2).unsqueeze(0)
            values = v_cache[start : start + length].permute(1, 0, 2).unsqueeze(0)
        else:
            shape = (num_seqs, len(self.gathered_heads), max_ctx, d)
            rows = self.context_rows(md)
            keys = k_cache.view(-1, d).index_select(0, rows).view(shape)
            values = v_cache.view(-1, d).index_select(0, rows).view(shape)
        keys, values, q = keys.to(compute), values.to(compute), q.to(compute)
        outs = []  # per group: [valid queries, num_heads · d]
        q_padded = None  # [num_tokens + 1, heads, d]: the step's queries and one zero query for padding
        for g in md.groups:
            g_keys, g_values = keys[g.seq_start : g.seq_end], values[g.seq_start : g.seq_end]
            bias = g.attn_bias if self.sliding_window is None else g.window_bias(self.sliding_window)
            if g.decode and compute == torch.float32:
                # [seqs, 1, 1, max_ctx]; one sequence attending over all its keys: no mask
                masked = num_seqs > 1 or self.sliding_window is not None or md.key_first is not None
                mask = bias[:, 0] if masked else None
                outs.append(self._decode_sdpa(q if md.decode_only else q[g.token_rows], g_keys, g_values, mask))
                continue
            if g.decode:
                q_pad = (q if md.decode_only else q[g.token_rows]).unsqueeze(1)  # [seqs, 1, heads, d]
            else:
                if q_padded is None:
                    q_padded = torch.cat([q, q.new_zeros(1, self.num_heads, d)])
                q_pad = q_padded[g.query_index]  # [seqs, max_q, heads, d]
            outs.append(self._padded_attention(q_pad, g_keys, g_values, bias)[g.query_valid])
        out = outs[0] if md.output_order is None else torch.cat(outs)[md.output_order]
        return out.to(k.dtype)

    def _padded_attention(
        self,
        q_pad: torch.Tensor,  # [seqs, max_q, num_heads, head_dim]
        keys: torch.Tensor,  # [seqs, kv_heads, max_context, head_dim] (kv_heads = num_heads if groups are uneven)
        values: torch.Tensor,  # same
        bias: torch.Tensor,  # [seqs, 1, 1, max_q, max_context] additive mask (QueryGroup.attn_bias or window_bias)
    ) -> torch.Tensor:  # [seqs, max_q, num_heads · head_dim]
        """One group's attention as two batched matmuls over [seqs, kv_heads, group · queries, keys]."""
        num_seqs, max_q, _, d = q_pad.shape
        max_ctx = keys.shape[2]
        kv_heads = len(self.gathered_heads)
        group = self.num_heads // kv_heads
        # Query heads of one KV head and their queries share the matmul's row dimension.
        qg = q_pad.view(num_seqs, max_q, kv_heads, group, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(num_seqs, kv_heads, group * max_q, d)  # [seqs, kv, group·q, d]
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # [seqs, kv, group·q, ctx]
        scores = scores.float().mul_(self.scale).view(num_seqs, kv_heads, group, max_q, max_ctx)
        probs = torch.softmax(scores.add_(bias), dim=-1).to(q_pad.dtype)
        out = torch.matmul(probs.view(num_seqs, kv_heads, group * max_q, max_ctx), values)  # [seqs, kv, group·q, d]
        return out.view(num_seqs, kv_heads, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, self.num_heads * d)

    def _decode_sdpa(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        keys: torch.Tensor,  # [num_seqs, kv_heads, max_context, head_dim] (kv_heads = num_heads if groups are uneven)
        values: torch.Tensor,  # same
        mask: torch.Tensor | None,  # [num_seqs, 1, 1, max_context] additive, None: every key
    ) -> torch.Tensor:  # [num_seqs, num_heads · head_dim]
        """Decodes in float32 through PyTorch's fused SDPA, faster on CPU than the two matmuls
        (not so in bfloat16); the same result up to float rounding."""
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [num_seqs, num_heads, 1, head_dim]
        return out.view(-1, self.num_heads * self.head_dim)
