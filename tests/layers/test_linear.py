"""``layers.linear.linear``: float16 on CPU goes through float32 past a few rows, and gives what
the native float16 matmul gives up to its last rounding; float32 on CPU with few rows runs as
(A·Xᵀ)ᵀ, equal to ``F.linear`` up to float32 rounding, every row computed as if alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec.layers.linear import CPU_FLOAT16_MAX_ROWS, CPU_FLOAT32_TRANSPOSED_MAX_ROWS, linear


@pytest.mark.parametrize("rows", [1, CPU_FLOAT16_MAX_ROWS, CPU_FLOAT16_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_float16_linear_matches_float32_math(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).half()
    w = (torch.randn(80, 96, generator=g) * 0.1).half()
    b = torch.randn(80, generator=g).half() if bias else None
    out = linear(x, w, b)
    assert out.dtype == torch.float16 and out.shape == (rows, 80)
    if rows > CPU_FLOAT16_MAX_ROWS:  # the float32 path, exactly
        assert torch.equal(out, F.linear(x.float(), w.float(), None if b is None else b.float()).half())
    else:  # the native float16 kernel, untouched
        assert torch.equal(out, F.linear(x, w, b))
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-3, atol=2e-3)


def test_bfloat16_uses_the_native_kernel():
    x, w = torch.randn(16, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 2, 7, CPU_FLOAT32_TRANSPOSED_MAX_ROWS, CPU_FLOAT32_TRANSPOSED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_few_rows_transposed(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, 80) and out.is_contiguous()
    if rows <= CPU_FLOAT32_TRANSPOSED_MAX_ROWS:
        xt = x.t() if rows > 1 else x.repeat(2, 1).t()
        ref = torch.mm(w, xt)[:, :rows].t() + (0 if b is None else b)
        assert torch.equal(out, ref)
    else:
        assert torch.equal(out, F.linear(x, w, b))
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
