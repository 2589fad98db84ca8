"""A weight's GGUF groups recovered a chunk of rows at a time (layers.row_chunks): for every format,
the chunks give what the whole weight gives, and a weight with one inexact row in a later chunk (past
the first row, which the recoveries check first) is refused."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.layers.gguf_weights import dequantized, gguf_round_trip
from tpspec.layers import q4_1, q4_k, q5_0, q6_k, q8_0, row_chunks

ROWS = 10  # three chunks of 4 rows, the last short


def _weights() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, 256, generator=g) * 0.05
    return {
        "q4_1": (q4_1.exact_groups, gguf_round_trip(w, gguf.GGMLQuantizationType.Q4_1)),
        "q8_0": (q8_0.exact_groups, gguf_round_trip(w, gguf.GGMLQuantizationType.Q8_0)),
        "q5_0": (q5_0.exact_groups, gguf_round_trip(w, gguf.GGMLQuantizationType.Q5_0)),
        "q4_k": (q4_k.exact_groups, dequantized(gguf.GGMLQuantizationType.Q4_K, ROWS, 256)),
        "q6_k": (q6_k.exact_groups, dequantized(gguf.GGMLQuantizationType.Q6_K, ROWS, 256)),
    }


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q5_0", "q4_k", "q6_k"])
def test_chunks_give_the_whole_weights_groups_and_refuse_an_inexact_row(kind, monkeypatch):
    exact_groups, w = _weights()[kind]
    whole = exact_groups.__wrapped__(w)  # the recovery itself, on all rows at once
    assert whole is not None
    monkeypatch.setattr(row_chunks, "CHUNK_ROWS", 4)
    chunked = exact_groups(w)
    assert chunked is not None and len(chunked) == len(whole)
    for a, b in zip(chunked, whole):
        assert a.dtype == b.dtype and torch.equal(a, b)
    inexact = w.clone()
    inexact[9, 5] += 1e-3  # in the last chunk
    assert exact_groups.__wrapped__(inexact) is None
    assert exact_groups(inexact) is None
