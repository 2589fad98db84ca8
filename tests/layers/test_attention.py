"""``Attention`` over the paged KV cache against a plain per-sequence softmax attention: prefill
chunks, speculative (k + 1 query) steps and decode steps (the fused-SDPA path, and tpspec's CPU
kernel: ``cpu_kernels_mode``), batched with padding and across query-length groups, with a
non-causal draft block, uniform GQA groups and an uneven head split, in float32, float16 and
bfloat16, with each sequence's blocks scattered or consecutive (a lone sequence in consecutive
blocks is read in place, not gathered). The cache
holds only the earlier tokens before the call: the attention writes the new tokens' K/V itself."""

from __future__ import annotations

import pytest
import torch

from tpspec.layers.attention import Attention, AttentionMetadata

BLOCK = 4
HEAD_DIM = 16


def _reference(q, keys, values, kv_of_head, query_start, tail=0, window=None, first=0):
    """q: [n_q, heads, d] for positions query_start.. ; keys/values: [ctx, kv_heads, d] -> [n_q, heads·d] (float32).
    The last ``tail`` positions see each other both ways; with ``window``, a query at p sees no key at or
    before p − window; no query sees a key before ``first``."""
    q, keys, values = q.float(), keys.float(), values.float()
    k = keys[:, kv_of_head]  # [ctx, heads, d]
    v = values[:, kv_of_head]
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    pos = torch.arange(keys.shape[0])
    qpos = query_start + torch.arange(q.shape[0])
    ctx = keys.shape[0]
    visible = (pos[None, :] <= qpos[:, None]) | ((pos[None, :] >= ctx - tail) & (qpos[:, None] >= ctx - tail))
    if window is not None:
        visible &= pos[None, :] > qpos[:, None] - window
    visible &= pos[None, :] >= first
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


# (the model's dtype, the cache's): a float32 model's default cache on CPU is float16 (kv_cache_dtype)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                               (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_of_head", [(4, [0, 0, 1, 1]), (3, [0, 1, 1])])  # uniform groups; uneven split
@pytest.mark.parametrize(
    "query_lens,context_lens,tail",
    [
        ([1, 1, 1], [9, 14, 5], None),  # decodes
        ([1], [11], None),
        ([6], [13], None),  # one sequence's prefill chunk
        ([4], [9], [4]),  # one sequence's draft block
        ([3, 1, 2], [9, 14, 5], None),  # mixed: a decode beside k + 1 queries
        ([4, 4], [9, 14], None),  # k + 1 queries
        ([1, 7, 2, 1, 16, 3], [9, 20, 5, 30, 18, 12], None),  # groups out of step order, padded within each
        ([1, 6], [4, 25], None),  # one decode beside a longer context: its keys are padded
        ([4, 1, 3], [9, 14, 7], [4, 0, 3]),  # non-causal draft blocks (DFlash)
        ([1, 1], [9, 14], [1, 0]),  # one query a sequence with and without a tail: decodes either way
    ],
)
@pytest.mark.parametrize("consecutive", [False, True])
def test_paged_attention_matches_reference(dtype, cache_dtype, heads, kv_of_head, query_lens, context_lens, tail,
                                           consecutive, cpu_kernels_mode):
    g = torch.Generator().manual_seed(len(query_lens) * 10 + heads)
    kv_heads = 2
    num_blocks = 64
    k_cache = torch.zeros(num_blocks * BLOCK, kv_heads, HEAD_DIM, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    if consecutive:  # each sequence's blocks one after the other, from block 5 + 10·i
        tables = [[5 + 10 * i + j for j in range(-(-c // BLOCK))] for i, c in enumerate(context_lens)]
    else:  # scattered, non-contiguous blocks per sequence
        tables = [[(7 * i + 3 * j + 1) % num_blocks for j in range(-(-c // BLOCK))] for i, c in enumerate(context_lens)]
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)
    keys = [torch.randn(c, kv_heads, HEAD_DIM, generator=g).to(dtype) for c in context_lens]
    values = [torch.randn(c, kv_heads, HEAD_DIM, generator=g).to(dtype) for c in context_lens]

    def slots(t, positions):
        return torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in positions], dtype=torch.int64)

    for t, kk, vv, n in zip(tables, keys, values, query_lens):  # earlier tokens already cached, not the new ones
        earlier = slots(t, range(kk.shape[0] - n))
        k_cache[earlier], v_cache[earlier] = kk[: kk.shape[0] - n].to(cache_dtype), vv[: vv.shape[0] - n].to(cache_dtype)
    q = [torch.randn(n, heads, HEAD_DIM, generator=g).to(dtype) for n in query_lens]
    new_k = torch.cat([kk[-n:] for kk, n in zip(keys, query_lens)])
    new_v = torch.cat([vv[-n:] for vv, n in zip(values, query_lens)])
    md = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, torch.device("cpu"), non_causal_tail=tail)
    assert md.decode_only == (max(query_lens) == 1)
    alone = consecutive and len(query_lens) == 1
    assert md.contiguous_slots == ((5 * BLOCK, context_lens[0]) if alone else None)
    attn = Attention(heads, kv_heads, HEAD_DIM, torch.tensor(kv_of_head))
    out = attn(torch.cat(q), new_k, new_v, (k_cache, v_cache), md)
    assert out.dtype == dtype and out.shape == (sum(query_lens), heads * HEAD_DIM)
    tails = tail or [0] * len(query_lens)
    ref = torch.cat([
        _reference(qq, kk, vv, kv_of_head, c - n, b)
        for qq, kk, vv, c, n, b in zip(q, keys, values, context_lens, query_lens, tails)
    ])
    tol = max({torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[t] for t in (dtype, cache_dtype))
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for t, kk, vv, n in zip(tables, keys, values, query_lens):  # the new tokens' K/V are cached for later steps
        new = slots(t, range(kk.shape[0] - n, kk.shape[0]))
        torch.testing.assert_close(k_cache[new], kk[-n:].to(k_cache.dtype))
        torch.testing.assert_close(v_cache[new], vv[-n:].to(v_cache.dtype))


@pytest.mark.parametrize("window", [1, 5, 64])
def test_sliding_window_attention_matches_reference(window, cpu_kernels_mode):
    """Gemma 3's local layers: decodes, k + 1 queries, a prefill chunk and a non-causal draft block in
    one step, each query seeing its window's keys only (float32: the kernel's path where loaded)."""
    g = torch.Generator().manual_seed(window)
    query_lens, context_lens, tail = [1, 4, 9, 3], [17, 12, 30, 10], [0, 0, 0, 3]
    tables = [[10 * i + j for j in range(-(-c // BLOCK))] for i, c in enumerate(context_lens)]
    k_cache = torch.zeros(64 * BLOCK, 2, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(c, 2, HEAD_DIM, generator=g) for c in context_lens]
    values = [torch.randn(c, 2, HEAD_DIM, generator=g) for c in context_lens]
    for t, kk, vv, n in zip(tables, keys, values, query_lens):
        earlier = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(kk.shape[0] - n)], dtype=torch.int64)
        k_cache[earlier], v_cache[earlier] = kk[: kk.shape[0] - n], vv[: vv.shape[0] - n]
    q = [torch.randn(n, 4, HEAD_DIM, generator=g) for n in query_lens]
    md = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, torch.device("cpu"), non_causal_tail=tail)
    attn = Attention(4, 2, HEAD_DIM, torch.tensor([0, 0, 1, 1]), sliding_window=window)
    out = attn(torch.cat(q), torch.cat([kk[-n:] for kk, n in zip(keys, query_lens)]),
               torch.cat([vv[-n:] for vv, n in zip(values, query_lens)]), (k_cache, v_cache), md)
    ref = torch.cat([
        _reference(qq, kk, vv, [0, 0, 1, 1], c - n, b, window)
        for qq, kk, vv, c, n, b in zip(q, keys, values, context_lens, query_lens, tail)
    ])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_query_sees_a_key_before_its_sequences_first_key(window, dtype, cpu_kernels_mode):
    """A drafter whose KV is written from some position on (``first_keys``): a decode, k + 1
    queries, a non-causal draft block and a lone sequence in consecutive blocks (read in place
    otherwise) see no key before their sequence's first key, whatever the cache holds there (stale
    keys that would take every query's attention, if seen), on the kernel's path and PyTorch's; a
    first key of 0 changes nothing."""
    g = torch.Generator().manual_seed(3)
    cases = [([1, 4, 3], [17, 12, 10], [0, 0, 3], [9, 0, 4]), ([5], [14], None, [6])]
    for query_lens, context_lens, tail, first_keys in cases:
        tables = [[10 * i + j for j in range(-(-c // BLOCK))] for i, c in enumerate(context_lens)]
        k_cache = torch.full((64 * BLOCK, 2, HEAD_DIM), 30.0, dtype=dtype)
        k_cache[:, :, ::2] = -30.0  # |score| ~ 30² · 16 · 0.25 for any query
        v_cache = torch.full_like(k_cache, 1e3)
        keys = [torch.randn(c, 2, HEAD_DIM, generator=g).to(dtype) for c in context_lens]
        values = [torch.randn(c, 2, HEAD_DIM, generator=g).to(dtype) for c in context_lens]
        for t, kk, vv, n, f in zip(tables, keys, values, query_lens, first_keys):  # written from f on only
            written = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(f, kk.shape[0] - n)], dtype=torch.int64)
            k_cache[written], v_cache[written] = kk[f : kk.shape[0] - n], vv[f : vv.shape[0] - n]
        q = [torch.randn(n, 4, HEAD_DIM, generator=g).to(dtype) for n in query_lens]
        md = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, torch.device("cpu"), non_causal_tail=tail,
                                     first_keys=first_keys)
        assert md.contiguous_slots is None
        attn = Attention(4, 2, HEAD_DIM, torch.tensor([0, 0, 1, 1]), sliding_window=window)
        out = attn(torch.cat(q), torch.cat([kk[-n:] for kk, n in zip(keys, query_lens)]),
                   torch.cat([vv[-n:] for vv, n in zip(values, query_lens)]), (k_cache, v_cache), md)
        ref = torch.cat([
            _reference(qq, kk, vv, [0, 0, 1, 1], c - n, b, window, f)
            for qq, kk, vv, c, n, b, f in zip(q, keys, values, context_lens, query_lens, tail or [0] * len(q), first_keys)
        ])
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    zero = AttentionMetadata.build([1], [5], [[0, 1]], BLOCK, torch.device("cpu"), first_keys=[0])
    assert zero.key_first is None and zero.contiguous_slots is not None
    with pytest.raises(ValueError, match="first_keys"):
        AttentionMetadata.build([2], [5], [[0, 1]], BLOCK, torch.device("cpu"), first_keys=[4])
