"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and per-request block tables.

The lowest-numbered free block goes first, so a sequence that grows alone (batch 1) gets
consecutive blocks, which attention reads in place (``AttentionMetadata.contiguous_slots``).
"""

from __future__ import annotations

import heapq

from tpspec.engine.sequence import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks))  # a min-heap

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            req.block_ids.append(heapq.heappop(self.free_blocks))
        return True

    def free(self, req: Request) -> None:
        for b in req.block_ids:
            heapq.heappush(self.free_blocks, b)
        req.block_ids = []
