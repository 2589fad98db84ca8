"""tpspec's CPU decode ops (layers.cpu_kernels, csrc/decode_ops.cpp) against PyTorch: the RMSNorm
with its residual add and single-query attention over the paged KV cache (grouped and uneven KV
heads, scattered slots, padding masks, head sizes off the kernel's 16-wide step); the layers take them only when loaded and outside
autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec.layers import cpu_kernels
from tpspec.layers.attention import Attention, AttentionMetadata
from tpspec.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")


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


def test_rms_norm_layer_takes_the_kernel_only_when_loaded_and_outside_autograd(cpu_kernels_mode, monkeypatch):
    norm = RMSNorm(64, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    calls = []
    if cpu_kernels.usable(x) is not None:
        module = cpu_kernels.kernels()

        class Counting:
            def add_rms_norm(self, *args):
                calls.append(args)
                return module.add_rms_norm(*args)

        monkeypatch.setattr(cpu_kernels, "_MODULE", Counting())
    out, total = norm(x, residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (64,), norm.weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(total, x + residual)
    assert len(calls) == (cpu_kernels_mode == "cpu-kernels")
    trained = x.clone().requires_grad_()
    norm(trained).sum().backward()  # autograd: PyTorch's ops, whatever is loaded
    assert trained.grad is not None and len(calls) == (cpu_kernels_mode == "cpu-kernels")


def _reference(q, k_cache, v_cache, slots, kv_head, mask, scale):
    """Gathered keys through SDPA in float64: q [S, H, d], caches [N, KVH, d], slots [S, L] -> [S, H·d]."""
    keys = k_cache[slots][:, :, kv_head].permute(0, 2, 1, 3).double()  # [S, H, L, d]
    values = v_cache[slots][:, :, kv_head].permute(0, 2, 1, 3).double()
    bias = None if mask is None else mask[:, None, None].double()
    out = F.scaled_dot_product_attention(q.unsqueeze(2).double(), keys, values, attn_mask=bias, scale=scale)
    return out.reshape(q.shape[0], -1).float()


@pytest.mark.parametrize("kv_head", [[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1], [0, 0]])  # GQA groups; uneven; d = 8
@pytest.mark.parametrize("length", [1, 7, 8, 33, 300])
def test_paged_decode_attention_equals_sdpa_over_scattered_slots(kv_head, length):
    heads, kv_heads, d = len(kv_head), max(kv_head) + 1, {9: 64, 4: 24, 2: 8}[len(kv_head)]
    g = torch.Generator().manual_seed(length + d)
    k_cache, v_cache = torch.randn(2, 2 * length + 5, kv_heads, d, generator=g)  # [slots, kv_heads, d]
    slots = torch.randperm(2 * length + 5, generator=g)[:length].view(1, length)  # the keys anywhere in the cache
    q = torch.randn(1, heads, d, generator=g)
    kv_head = torch.tensor(kv_head)
    out = cpu_kernels.kernels().paged_decode_attention(q, k_cache, v_cache, slots, kv_head, None, d**-0.5)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, slots, kv_head, None, d**-0.5), rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_masks_padded_keys_without_reading_them():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 19, 1]
    k_cache, v_cache = torch.randn(2, 40, 2, 16, generator=g)
    slots = torch.randint(1, 40, (3, 19), generator=g)  # never slot 0
    mask = torch.tensor([[0.0 if t < n else float("-inf") for t in range(19)] for n in lengths])  # [S, L]
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[0], poisoned_v[0] = float("nan"), float("nan")  # slot 0: where padding points
    padded = torch.where(mask == 0, slots, 0)
    q = torch.randn(3, 4, 16, generator=g)
    kv_head = torch.tensor([0, 0, 1, 1])
    out = cpu_kernels.kernels().paged_decode_attention(q, poisoned_k, poisoned_v, padded, kv_head, mask, 0.25)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, slots, kv_head, mask, 0.25), rtol=1e-5, atol=1e-5)
    for s, n in enumerate(lengths):  # the same as attending over the sequence's own keys alone
        alone = cpu_kernels.kernels().paged_decode_attention(q[s : s + 1], k_cache, v_cache, slots[s : s + 1, :n].contiguous(),
                                                             kv_head, None, 0.25)
        torch.testing.assert_close(out[s : s + 1], alone, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_slots_outside_the_cache():
    k_cache = torch.zeros(8, 1, 8)
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        cpu_kernels.kernels().paged_decode_attention(torch.zeros(1, 1, 8), k_cache, k_cache, torch.tensor([[3, 8]]),
                                                     torch.tensor([0]), None, 1.0)


def test_attention_layer_reads_the_cache_through_the_kernel_for_float32_decode_steps_only(monkeypatch):
    module, calls = cpu_kernels.kernels(), []

    class Counting:
        def paged_decode_attention(self, *args):
            calls.append(args)
            return module.paged_decode_attention(*args)

    monkeypatch.setattr(cpu_kernels, "_MODULE", Counting())
    attn = Attention(4, 2, 16, torch.tensor([0, 0, 1, 1]))
    cache = (torch.randn(64, 2, 16), torch.randn(64, 2, 16))
    for query_lens, kernel_calls in (([1, 1], 1), ([2, 1], 0)):  # a decode step; one with k + 1 queries
        calls.clear()
        md = AttentionMetadata.build(query_lens, [5, 9], [[0, 1], [2, 3, 4]], 4, torch.device("cpu"))
        n = sum(query_lens)
        attn(torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16), cache, md)
        assert len(calls) == kernel_calls
        if calls:
            assert calls[0][3] is md.context_slots  # the cache read in place, at every key's slot
