"""tpspec's CPU decode ops (layers.cpu_kernels, csrc/decode_ops.cpp) against PyTorch: the RMSNorm
with its residual add and single-query attention (grouped KV heads, strided cache views, padding
masks, head sizes off the kernel's 16-wide step); the layers take them only when loaded and outside
autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec.layers import cpu_kernels
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
    if cpu_kernels.for_decode(x) is not None:
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


def _sdpa(q, keys, values, mask, scale):
    """The reference: q [S, H, d], keys/values [S, KVH, L, d], mask [S, L] or None -> [S, H·d]."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2).double(), keys.double(), values.double(),
                                         attn_mask=None if mask is None else mask[:, None, None].double(),
                                         scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1).float()


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 24), (2, 1, 8)])
@pytest.mark.parametrize("length", [1, 7, 8, 33, 300])
def test_decode_attention_equals_sdpa_on_strided_cache_views(heads, kv_heads, d, length):
    g = torch.Generator().manual_seed(length + d)
    cache_k, cache_v = torch.randn(2, length + 5, kv_heads, d, generator=g)  # [slots, kv_heads, d], as the KV cache
    keys = cache_k[2 : 2 + length].permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, L, d], strided
    values = cache_v[2 : 2 + length].permute(1, 0, 2).unsqueeze(0)
    q = torch.randn(1, heads, d, generator=g)
    out = cpu_kernels.kernels().decode_attention(q, keys, values, None, d**-0.5)
    torch.testing.assert_close(out, _sdpa(q, keys, values, None, d**-0.5), rtol=1e-5, atol=1e-5)


def test_decode_attention_masks_padded_keys():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 19, 1]
    keys, values = torch.randn(2, 3, 2, 19, 16, generator=g)  # [S, KVH, L, d]
    mask = torch.tensor([[0.0 if t < n else float("-inf") for t in range(19)] for n in lengths])  # [S, L]
    keys_garbage = keys.clone()
    keys_garbage[0, :, 5:] = 1e6  # padding never counts, however large
    q = torch.randn(3, 4, 16, generator=g)
    out = cpu_kernels.kernels().decode_attention(q, keys_garbage, values, mask, 0.25)
    torch.testing.assert_close(out, _sdpa(q, keys, values, mask, 0.25), rtol=1e-5, atol=1e-5)
    for s, n in enumerate(lengths):  # the same as attending over the sequence's own keys alone
        alone = cpu_kernels.kernels().decode_attention(q[s : s + 1], keys[s : s + 1, :, :n], values[s : s + 1, :, :n], None, 0.25)
        torch.testing.assert_close(out[s : s + 1], alone, rtol=1e-5, atol=1e-5)
