"""Paged KV-cache bookkeeping: a free list of fixed-size blocks and per-request block tables."""

from __future__ import annotations

from collections import deque

from tpspec.engine.sequence import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

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
            req.block_ids.append(self.free_blocks.popleft())
        return True

    def free(self, req: Request) -> None:
        self.free_blocks.extend(reversed(req.block_ids))
        req.block_ids = []
