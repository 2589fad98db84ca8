"""``layers.linear.linear``: float16 on CPU goes through float32 past a few rows, and gives what
the native float16 matmul gives up to its last rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpspec.layers.linear import CPU_FLOAT16_MAX_ROWS, linear


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_dtypes_use_the_native_kernel(dtype):
    x, w = torch.randn(16, 32).to(dtype), torch.randn(8, 32).to(dtype)
    assert torch.equal(linear(x, w), F.linear(x, w))
