"""tpspec's CPU decode ops (layers.cpu_kernels, csrc/decode_ops.cpp) against PyTorch: the RMSNorm
with its residual add, the rotary embedding, SwiGLU, and attention of a few queries per sequence over the paged KV cache, each
over its own key range (grouped and uneven KV heads, scattered slots, windows, head sizes and key
counts off the kernel's blocks); the layers take them only when loaded and outside autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec import cpu_features
from tpspec.layers import cpu_kernels
from tpspec.layers.activation import silu_and_mul
from tpspec.layers.attention import Attention, AttentionMetadata
from tpspec.layers.norm import RMSNorm
from tpspec.layers.rotary import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")


HAS_WIDE = all(f in cpu_features.cpu_model_and_isa()[1] for f in cpu_kernels.WIDE_ISA)
# paged attention's paths: 8 lanes (AVX2) and 16 (AVX-512, where the CPU has it)
WIDE_PATHS = [pytest.param(False, id="avx2"),
              pytest.param(True, id="avx512", marks=pytest.mark.skipif(not HAS_WIDE, reason="no AVX-512 here"))]


def _count_calls(monkeypatch, op: str) -> list:
    """The argument tuples of every later call of the loaded kernels' ``op`` (none where they are
    not loaded: the layers then take their PyTorch path)."""
    module, calls = cpu_kernels._MODULE, []
    if module is not None:
        class Counting:
            def __getattr__(self, name):
                fn = getattr(module, name)
                if name != op:
                    return fn

                def counted(*args):
                    calls.append(args)
                    return fn(*args)
                return counted
        monkeypatch.setattr(cpu_kernels, "_MODULE", Counting())
    return calls


@pytest.mark.parametrize("rows,width", [(1, 576), (5, 64), (3, 8)])
def test_add_rms_norm_equals_pytorch(rows, width):
    g = torch.Generator().manual_seed(rows)
    x, residual, w = (torch.randn(rows, width, generator=g) for _ in range(3))
    out, total = cpu_kernels.kernels().add_rms_norm(x, residual, w[0].contiguous(), 1e-6)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (width,), w[0], 1e-6), rtol=1e-6, atol=1e-6)
    alone, same = cpu_kernels.kernels().add_rms_norm(x, None, w[0].contiguous(), 1e-6)
    assert same is x
    torch.testing.assert_close(alone, F.rms_norm(x, (width,), w[0], 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,heads,d", [(1, 12, 64), (7, 3, 16), (70, 2, 128)])
def test_rotary_gives_pytorchs_bits_for_strided_heads(rows, heads, d):
    """The kernel rounds as the PyTorch ops do (two products, then their sum), reading query and key
    heads in place from a fused projection's output (rows strided past other columns); more rows
    than a thread's share take both threads."""
    g = torch.Generator().manual_seed(rows)
    rope = RotaryEmbedding(d, 4096, 10000.0)
    qkv = torch.randn(rows, heads * d + 40, generator=g) * 30
    x = qkv[:, : heads * d].view(rows, heads, d)  # [rows, heads, d], row stride heads·d + 40
    angles = rope.angles(torch.randint(0, 4096, (rows,), generator=g), torch.float32)
    out = cpu_kernels.kernels().rotary(x, angles.cos, angles.sin)
    assert out.is_contiguous()
    assert torch.equal(out, x * angles.cos + x.roll(d // 2, -1) * angles.sin)


def test_apply_rope_takes_the_kernel_only_when_loaded_and_outside_autograd(cpu_kernels_mode, monkeypatch):
    rope = RotaryEmbedding(64, 128, 10000.0)
    angles = rope.angles(torch.tensor([3, 70]), torch.float32)
    x = torch.randn(2, 4, 64)
    calls = _count_calls(monkeypatch, "rotary")
    expected = x * angles.cos + x.roll(32, -1) * angles.sin
    assert torch.equal(apply_rope(x, angles), expected)
    assert len(calls) == (1 if cpu_kernels_mode == "cpu-kernels" else 0)
    x.requires_grad_(True)
    with torch.enable_grad():
        apply_rope(x, angles).sum().backward()  # autograd: the PyTorch ops
    assert len(calls) == (1 if cpu_kernels_mode == "cpu-kernels" else 0) and x.grad is not None


@pytest.mark.parametrize("rows,width", [(1, 1536), (3, 8), (40, 64)])
def test_silu_and_mul_equals_pytorch(rows, width):
    """Within float32 rounding of F.silu(gate) · up, over gates from −90 to 90 (σ's two branches,
    exp's underflow), the infinities and NaN included."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * width, generator=g) * 30
    x[0, :4] = torch.tensor([float("inf"), float("nan"), -90.0, 90.0])
    out = cpu_kernels.kernels().silu_and_mul(x)
    expected = F.silu(x[:, :width]) * x[:, width:]
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-30, equal_nan=True)


def test_silu_and_mul_takes_the_kernel_only_when_loaded_and_outside_autograd(cpu_kernels_mode, monkeypatch):
    x = torch.randn(2, 32)
    calls = _count_calls(monkeypatch, "silu_and_mul")
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :16]) * x[:, 16:], rtol=2e-6, atol=0)
    assert len(calls) == (1 if cpu_kernels_mode == "cpu-kernels" else 0)
    x.requires_grad_(True)
    with torch.enable_grad():
        silu_and_mul(x).sum().backward()  # autograd: the PyTorch ops
    assert len(calls) == (1 if cpu_kernels_mode == "cpu-kernels" else 0) and x.grad is not None


def test_rms_norm_layer_takes_the_kernel_only_when_loaded_and_outside_autograd(cpu_kernels_mode, monkeypatch):
    norm = RMSNorm(64, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    calls = _count_calls(monkeypatch, "add_rms_norm")
    out, total = norm(x, residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (64,), norm.weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(total, x + residual)
    assert len(calls) == (cpu_kernels_mode == "cpu-kernels")
    trained = x.clone().requires_grad_()
    norm(trained).sum().backward()  # autograd: PyTorch's ops, whatever is loaded
    assert trained.grad is not None and len(calls) == (cpu_kernels_mode == "cpu-kernels")


def _reference(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, scale):
    """Per query, its key range gathered, softmax attention in float64: q [T, H, d], caches [N, KVH, d],
    slots [S, L], token_seq [T], key_range [T, 2] -> [T, H·d]."""
    out = []
    for t in range(q.shape[0]):
        first, end = key_range[t].tolist()
        rows = slots[token_seq[t], first:end]
        keys, values = k_cache[rows][:, kv_head].double(), v_cache[rows][:, kv_head].double()  # [n, H, d]
        if end == first:
            out.append(torch.zeros(q.shape[1] * q.shape[2]))
            continue
        probs = (torch.einsum("hd,khd->hk", q[t].double(), keys) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, values).reshape(-1).float())
    return torch.stack(out)


@pytest.mark.parametrize("kv_head", [[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 0], [0, 0]])  # GQA; uneven; d = 8
@pytest.mark.parametrize("length", [1, 7, 8, 33, 300])
@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("wide", WIDE_PATHS)
def test_paged_attention_equals_a_gathered_softmax_over_scattered_slots(kv_head, length, queries, wide):
    """Causal queries (the last ``queries`` positions) of one sequence, its keys anywhere in the cache;
    head sizes off the kernel's 64-column block (24) and its 8-key block (lengths 1, 7, 33)."""
    heads, kv_heads, d = len(kv_head), max(kv_head) + 1, {9: 64, 7: 24, 2: 8}[len(kv_head)]
    g = torch.Generator().manual_seed(length + d + queries)
    k_cache, v_cache = torch.randn(2, 2 * length + 5, kv_heads, d, generator=g)  # [slots, kv_heads, d]
    slots = torch.randperm(2 * length + 5, generator=g)[:length].view(1, length)
    queries = min(queries, length)
    q = torch.randn(queries, heads, d, generator=g)
    token_seq = torch.zeros(queries, dtype=torch.int64)
    key_range = torch.tensor([[0, length - queries + 1 + i] for i in range(queries)])
    kv_head = torch.tensor(kv_head)
    out = cpu_kernels.kernels().paged_attention(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, d**-0.5, wide)
    ref = _reference(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide", WIDE_PATHS)
def test_paged_attention_reads_only_each_querys_key_range(wide):
    """Several sequences' queries, padded slot rows, windows and empty ranges: keys outside a query's
    range are never read (NaN there would show), an empty range gives zeros."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 60, 2, 16, generator=g)
    slots = torch.randint(1, 60, (3, 19), generator=g)  # never slot 0
    token_seq = torch.tensor([0, 1, 1, 1, 2, 0])
    key_range = torch.tensor([[0, 5], [0, 17], [3, 18], [10, 19], [0, 1], [2, 2]])  # causal, windows, one key, none
    read = torch.zeros(3, 19, dtype=torch.bool)
    for s, (first, end) in zip(token_seq.tolist(), key_range.tolist()):
        read[s, first:end] = True
    poisoned = torch.where(read, slots, 0)  # every slot no query reads points at slot 0, NaN
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[0], poisoned_v[0] = float("nan"), float("nan")
    q = torch.randn(6, 4, 16, generator=g)
    kv_head = torch.tensor([0, 0, 1, 1])
    out = cpu_kernels.kernels().paged_attention(q, poisoned_k, poisoned_v, poisoned, token_seq, key_range, kv_head, 0.25,
                                                wide)
    ref = _reference(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[5], torch.zeros(64))


@pytest.mark.parametrize("window", [None, 13, 42])
@pytest.mark.parametrize("wide", WIDE_PATHS)
def test_paged_attention_gives_a_query_the_same_bits_alone_and_among_others(window, wide):
    """A query's output depends on its own q, key range and keys only: alone, inside one sequence's run
    of up to 7 queries (a verification, a prefill chunk: the kernel scores a run's queries together,
    each key loaded once for all of them) or beside other sequences, its bits are the same (a max or
    sum shared across the run would keep the values within rounding and change the bits). With a
    window the queries of a run start at different keys (with 42, in different 8-key blocks, and
    their keys span several of the output loop's tiles and two of its key spans), and on one thread
    or two."""
    g = torch.Generator().manual_seed(1)
    length, d = 150, 64
    k_cache, v_cache = torch.randn(2, 400, 3, d, generator=g)
    slots = torch.randperm(400, generator=g)[: 2 * length].view(2, length)
    kv_head = torch.arange(9) // 3
    q = torch.randn(7, 9, d, generator=g)
    ends = list(range(length - 6, length + 1))  # a causal run of 7 queries of sequence 0
    key_range = torch.tensor([[0 if window is None else max(0, e - window), e] for e in ends])

    def run(rows: list[int], other_sequence: bool) -> torch.Tensor:
        qs, ranges, seqs = q[rows], key_range[rows], torch.zeros(len(rows), dtype=torch.int64)
        if other_sequence:  # a decode of sequence 1 in front
            qs = torch.cat([q[:1] * 0.5, qs])
            ranges = torch.cat([torch.tensor([[0, 40]]), ranges])
            seqs = torch.cat([torch.tensor([1]), seqs])
        out = cpu_kernels.kernels().paged_attention(qs.contiguous(), k_cache, v_cache, slots, seqs, ranges, kv_head, 0.125,
                                                    wide)
        return out[int(other_sequence):]

    together = run(list(range(7)), False)
    torch.testing.assert_close(together, _reference(q, k_cache, v_cache, slots, torch.zeros(7, dtype=torch.int64),
                                                    key_range, kv_head, 0.125), rtol=1e-5, atol=1e-5)
    for t in range(7):
        assert torch.equal(run([t], False)[0], together[t])
        assert torch.equal(run([t], True)[0], together[t])
    assert torch.equal(run([2, 3, 4], True), together[2:5])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work items are cut per thread: one thread takes them all
    try:
        assert torch.equal(run(list(range(7)), True), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("queries,window", [(1, None), (4, None), (4, 42), (40, None)])  # decode, verification, chunk
@pytest.mark.parametrize("wide", WIDE_PATHS)
def test_a_float16_cache_gives_the_bits_of_a_float32_cache_holding_its_values(queries, window, wide):
    """The kernel widens a float16 cache's values exactly as it reads them (keys and values, the
    output loop's 64-column blocks and its 8-column rest: d = 72): its output has the bits of the
    same call on a float32 cache holding the same (float16-rounded) values, for two sequences'
    decodes, verifications and a prefill chunk, with a window too."""
    g = torch.Generator().manual_seed(queries)
    length, d = 300, 72
    k16, v16 = torch.randn(2, 700, 3, d, generator=g).half()
    slots = torch.randperm(700, generator=g)[: 2 * length].view(2, length)
    kv_head = torch.arange(9) // 3
    q = torch.randn(2 * queries, 9, d, generator=g)
    token_seq = torch.tensor([0] * queries + [1] * queries)
    ends = [length - queries + 1 + i for i in range(queries)] * 2
    key_range = torch.tensor([[0 if window is None else max(0, e - window), e] for e in ends])
    kernels = cpu_kernels.kernels()
    out16 = kernels.paged_attention(q, k16, v16, slots, token_seq, key_range, kv_head, 0.125, wide)
    out32 = kernels.paged_attention(q, k16.float(), v16.float(), slots, token_seq, key_range, kv_head, 0.125, wide)
    assert torch.equal(out16, out32)
    ref = _reference(q, k16.float(), v16.float(), slots, token_seq, key_range, kv_head, 0.125)
    torch.testing.assert_close(out16, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="both the same"):  # a float16 K beside a float32 V
        kernels.paged_attention(q, k16, v16.float(), slots, token_seq, key_range, kv_head, 0.125, wide)


def test_paged_attention_takes_a_long_chunk_in_groups_with_the_same_bits():
    """A prefill chunk of 128 queries over 8,192 keys (64 spans each: more span partials than the
    kernel keeps at once, so its runs are taken in groups): each query gets the bits it gets
    alone, and the reference's numbers."""
    g = torch.Generator().manual_seed(3)
    length, d, queries = 8192, 64, 128
    k_cache, v_cache = torch.randn(2, length + 16, 3, d, generator=g)
    slots = torch.randperm(length + 16, generator=g)[:length].view(1, length)
    kv_head = torch.arange(9) // 3
    q = torch.randn(queries, 9, d, generator=g)
    key_range = torch.tensor([[0, length - queries + 1 + i] for i in range(queries)])
    token_seq = torch.zeros(queries, dtype=torch.int64)
    kernels = cpu_kernels.kernels()
    out = kernels.paged_attention(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, 0.125, False)
    for t in (0, 63, 64, 127):  # in the first group and in the last
        alone = kernels.paged_attention(q[t : t + 1].contiguous(), k_cache, v_cache, slots, token_seq[:1],
                                        key_range[t : t + 1], kv_head, 0.125, False)
        assert torch.equal(alone[0], out[t]), t
        ref = _reference(q[t : t + 1], k_cache, v_cache, slots, token_seq[:1], key_range[t : t + 1], kv_head, 0.125)
        torch.testing.assert_close(out[t : t + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_WIDE, reason="no AVX-512 here")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 72, 128])  # one 64-column block; with an 8-column rest; two blocks
def test_the_avx512_path_gives_the_avx2_paths_bits(cache_dtype, d):
    """The output loops on 16 lanes take the same multiply-adds as on 8, in the same key order (a
    column's sum is its own lane's): decodes of three sequences, a 7-query verification with a window
    (its queries' outputs paired), a 40-query chunk, over spans, tiles and 8-key blocks cut anywhere."""
    g = torch.Generator().manual_seed(d)
    length = 300
    k_cache, v_cache = torch.randn(2, 1000, 3, d, generator=g).to(cache_dtype)
    slots = torch.randperm(1000, generator=g)[: 3 * length].view(3, length)
    kv_head = torch.arange(9) // 3
    ends = [257, 300, 131] + list(range(294, 301)) + list(range(101, 141))
    token_seq = torch.tensor([0, 1, 2] + [1] * 7 + [2] * 40)
    key_range = torch.tensor([[0, e] for e in ends[:3]] + [[max(0, e - 42), e] for e in ends[3:10]] + [[0, e] for e in ends[10:]])
    q = torch.randn(len(ends), 9, d, generator=g)
    kernels = cpu_kernels.kernels()
    narrow = kernels.paged_attention(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, 0.125, False)
    wide = kernels.paged_attention(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, 0.125, True)
    assert torch.equal(wide, narrow)
    ref = _reference(q, k_cache.float(), v_cache.float(), slots, token_seq, key_range, kv_head, 0.125)
    torch.testing.assert_close(wide, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slots,token_seq,key_range,message", [
    ([[3, 8]], [0], [[0, 2]], "a slot outside the cache"),
    ([[3, 4]], [1], [[0, 2]], "a query of a sequence outside slots"),
    ([[3, 4]], [0], [[0, 3]], "a key range outside"),
    ([[3, 4]], [0], [[2, 1]], "a key range outside"),
])
def test_paged_attention_refuses_indices_outside_its_inputs(slots, token_seq, key_range, message):
    k_cache = torch.zeros(8, 1, 8)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.kernels().paged_attention(torch.zeros(1, 1, 8), k_cache, k_cache, torch.tensor(slots),
                                              torch.tensor(token_seq), torch.tensor(key_range), torch.tensor([0]), 1.0, False)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_write_kv_stores_the_bits_of_index_copy(cache_dtype, rows):
    """Keys and values with rows strided as the model hands them over (keys: heads of the rotary
    output [rows, q + k heads, d]; values: columns of the fused projection's output [rows, q | k | v])
    land in their slots with the bits of ``index_copy_(k.to(cache))``: float16's rounding to
    nearest even, subnormals, overflow to inf and NaN included; the other slots untouched."""
    torch.manual_seed(rows)
    kv_heads, d = 3, 16
    k = (torch.randn(rows, 4 + kv_heads, d) * 3)[:, 4:]  # [rows, kv_heads, d], rows 7·d apart
    k[0, 0, :4] = torch.tensor([1e-6, 70000.0, float("nan"), 2.0**-24 * 1.5])  # float16 edge cases
    v = (torch.randn(rows, (4 + 2 * kv_heads) * d) * 3)[:, (4 + kv_heads) * d :].view(rows, kv_heads, d)  # 10·d apart
    slot_mapping = torch.randperm(64)[:rows]
    caches = [(torch.randn(64, kv_heads, d).to(cache_dtype), torch.randn(64, kv_heads, d).to(cache_dtype)) for _ in range(2)]
    expected, got = caches[0], (caches[1][0].copy_(caches[0][0]), caches[1][1].copy_(caches[0][1]))
    expected[0].index_copy_(0, slot_mapping, k.to(cache_dtype))
    expected[1].index_copy_(0, slot_mapping, v.to(cache_dtype))
    cpu_kernels.kernels().write_kv(k, v, got[0], got[1], slot_mapping)
    for e, g in zip(expected, got):
        assert torch.equal(e.view(torch.int16 if cache_dtype == torch.float16 else torch.int32),
                           g.view(torch.int16 if cache_dtype == torch.float16 else torch.int32))


def test_write_kv_refuses_a_slot_outside_the_cache():
    k_cache = torch.zeros(8, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.kernels().write_kv(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), k_cache, k_cache.clone(), torch.tensor([8]))


@pytest.mark.parametrize("model_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                     (torch.float16, torch.float16)])
def test_attention_layer_takes_the_kernel_for_every_float32_step(model_dtype, cache_dtype, monkeypatch):
    """Float32 steps, over a float32 or a float16 cache (a float16 model's queries widened), read
    the cache in place through the kernel; bfloat16 attends through PyTorch."""
    cpu_kernels.kernels()  # loaded
    calls = _count_calls(monkeypatch, "paged_attention")
    writes = _count_calls(monkeypatch, "write_kv")  # wrapping the counting module above
    attn = Attention(4, 2, 16, torch.tensor([0, 0, 1, 1]))
    cache = (torch.randn(128, 2, 16).to(cache_dtype), torch.randn(128, 2, 16).to(cache_dtype))
    for query_lens in ([1, 1], [4, 1], [16, 1], [17, 1], [21, 9]):  # decodes, verification, prefill chunks
        calls.clear()
        md = AttentionMetadata.build(query_lens, [21, 9], [list(range(6)), [8, 7, 6]], 4, torch.device("cpu"))
        n = sum(query_lens)
        qkv = [torch.randn(n, h, 16).to(model_dtype) for h in (4, 2, 2)]
        written = (cache[0].clone().index_copy_(0, md.slot_mapping, qkv[1].to(cache_dtype)),
                   cache[1].clone().index_copy_(0, md.slot_mapping, qkv[2].to(cache_dtype)))
        attn(*qkv, cache, md)
        assert len(calls) == 1
        assert calls[0][3] is md.context_slots  # the cache read in place, at every key's slot
        assert torch.equal(cache[0], written[0]) and torch.equal(cache[1], written[1])  # the new keys in their slots
        assert len(writes) == (1 if model_dtype == torch.float32 else 0)  # one call (a float16 model's: PyTorch's)
        writes.clear()
    calls.clear()
    md = AttentionMetadata.build([1], [9], [[0, 1, 2]], 4, torch.device("cpu"))
    bf16_cache = (cache[0].bfloat16(), cache[1].bfloat16())
    attn(torch.randn(1, 4, 16).bfloat16(), torch.randn(1, 2, 16).bfloat16(), torch.randn(1, 2, 16).bfloat16(), bf16_cache, md)
    assert not calls  # bfloat16 attends through PyTorch
