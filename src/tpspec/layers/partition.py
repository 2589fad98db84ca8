"""How a dimension is split over TP ranks: contiguous ranges, as even as possible."""

from __future__ import annotations


def split_sizes(n: int, parts: int) -> list[int]:
    """Contiguous split of ``n`` items into ``parts`` sizes; the first ``n % parts`` get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def split_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s share of ``n`` items."""
    sizes = split_sizes(n, parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def head_partition(num_heads: int, num_kv_heads: int, parts: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Query-head and KV-head ranges of ``rank``.

    Query heads are split contiguously and as evenly as possible (so 9 heads work at TP 2 and 4);
    a rank holds every KV head its query heads read, so a KV head may live on two ranks.
    """
    q0, q1 = split_range(num_heads, parts, rank)
    group = num_heads // num_kv_heads
    return (q0, q1), (q0 // group, (q1 - 1) // group + 1)


def pad_vocab(vocab_size: int, tp_size: int, multiple: int = 64) -> int:
    """Vocab padded to a multiple of 64 (of 64·tp if 64 does not split evenly over the ranks)."""
    padded = -(-vocab_size // multiple) * multiple
    if padded % tp_size:
        padded = -(-vocab_size // (multiple * tp_size)) * multiple * tp_size
    return padded
