"""``layers.argmax.argmax_rows`` (tpspec's CPU kernel, ``csrc/argmax.cpp``) gives ``torch.argmax``'s
answer bit for bit: the first of equal maxima (-0 and +0 equal), the first NaN above everything, 0
for a row of -inf, rows of any width (the kernel's 8 lanes, its tails and its chunks of 8,192
values) and any row stride, on one thread or two; and the greedy paths take it."""

from __future__ import annotations

import pytest
import torch

from tpspec.layers import cpu_kernels
from tpspec.layers.argmax import argmax_rows

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")

WIDTHS = [1, 7, 8, 9, 15, 17, 8191, 8192, 8193, 16385, 49152]


def _rows(kind: str, rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, width, generator=g)
    if kind == "ties":  # few distinct values: many equal maxima
        return torch.randint(-3, 3, (rows, width), generator=g).float()
    if kind == "signed zeros":  # the maxima are -0 and +0, which compare equal
        x = torch.full((rows, width), -1.0)
        picks = torch.randint(0, width, (rows, 4), generator=g)
        x.scatter_(1, picks[:, :2], -0.0)
        return x.scatter_(1, picks[:, 2:], 0.0)
    if kind == "minus inf":
        return torch.full((rows, width), float("-inf"))
    if kind == "nan":  # NaN outranks +inf; the first NaN wins
        x = torch.randn(rows, width, generator=g)
        x[:, -1] = float("inf")
        return x.scatter_(1, torch.randint(0, width, (rows, 3), generator=g), float("nan"))
    if kind == "strided":  # rows of a wider tensor (logits cut to the vocabulary)
        return torch.randn(rows, width + 9, generator=g)[:, 4 : 4 + width]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "ties", "signed zeros", "minus inf", "nan", "strided"])
@pytest.mark.parametrize("width", WIDTHS)
def test_argmax_rows_is_torch_argmax(kind, width, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_MODULE", cpu_kernels.kernels())
    g = torch.Generator().manual_seed(width)
    for rows in (1, 3, 32):
        x = _rows(kind, rows, width, g)
        expected = x.argmax(dim=-1)
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = cpu_kernels.kernels().argmax_rows(x)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(got, expected), (kind, width, rows, threads)
        assert torch.equal(argmax_rows(x), expected)


def test_argmax_rows_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    module = cpu_kernels.kernels()

    class Counting:
        def argmax_rows(self, x):
            calls.append(x.shape)
            return module.argmax_rows(x)
    monkeypatch.setattr(cpu_kernels, "_MODULE", Counting())
    x = torch.randn(4, 100)
    assert torch.equal(argmax_rows(x), x.argmax(-1)) and calls == [(4, 100)]
    for other in (x.bfloat16(), x.t().contiguous().t(), x[:, :0]):  # not float32; columns strided; no columns
        if other.shape[1]:
            assert torch.equal(argmax_rows(other), other.argmax(-1))
    assert len(calls) == 1
    monkeypatch.setattr(cpu_kernels, "_MODULE", None)  # not loaded: PyTorch's
    assert torch.equal(argmax_rows(x), x.argmax(-1)) and len(calls) == 1
