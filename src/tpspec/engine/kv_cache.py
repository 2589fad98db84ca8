"""Paged KV-cache bookkeeping: fixed-size blocks, per-request block tables, and automatic prefix
caching.

A block is referenced by every request whose table holds it. With prefix caching, a full block
whose target KV is written and whose drafter KV is settled (written, or given up by a drafter that
let a held request's backlog go) is registered under its hash (``block_hash``), noting whether it
holds the drafter's KV; a later request whose tokens start with the same blocks takes them
instead of computing them (``take_cached``), its drafter context starting after the last taken
block without drafter KV. A registered block nobody references stays cached in an LRU of evictable
blocks until a new block is needed and no never-cached block is free; freeing a request puts its
blocks last-first, so a chain's tail is evicted before its head, which more requests share.

New blocks come lowest-numbered first, so a sequence that grows alone (batch 1) gets consecutive
blocks, which attention reads in place (``AttentionMetadata.contiguous_slots``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from tpspec.engine.block_hash import extend_block_hashes
from tpspec.engine.sequence import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, hash_lookahead: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_lookahead = hash_lookahead  # tokens after a block that its drafter KV depends on
        self.free_blocks: list[int] = list(range(num_blocks))  # a min-heap of blocks holding nothing cached
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # a registered block's hash
        self.has_drafter_kv = [False] * num_blocks  # a registered block's drafter KV is written
        self.cached: dict[bytes, int] = {}  # hash -> registered block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; least recently freed first
        self.num_queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hit_tokens = 0  # of which found cached (prefix_cache_hits)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they are evicted when needed)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need > self.num_free_blocks:
            return False
        for _ in range(max(0, need)):
            req.block_ids.append(self._new_block())
        return True

    def _new_block(self) -> int:
        if self.free_blocks:
            b = heapq.heappop(self.free_blocks)
        else:  # evict the least recently freed cached block
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hashes[b]]
            self.block_hashes[b] = None
        self.ref_counts[b] = 1
        return b

    def free(self, req: Request) -> None:
        """Drop ``req``'s references, its last block first."""
        for b in reversed(req.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is not None:
                    self.evictable[b] = None
                else:
                    heapq.heappush(self.free_blocks, b)
        req.block_ids = []
        req.num_cached_blocks = 0

    # ---- prefix caching ------------------------------------------------------------------------
    def take_cached(self, req: Request) -> int:
        """For a request about to be admitted with nothing computed: take the cached blocks its
        tokens start with into its (empty) table and return how many tokens they hold. Its last
        token is never among them: computing it gives the logits of the request's next token.
        Sets ``req.drafter_start`` past the last taken block without drafter KV."""
        req.drafter_start = 0
        if not self.enable_caching or req.block_ids:
            return 0
        extend_block_hashes(req.block_hashes, req.all_token_ids, req.num_tokens - 1 + self.hash_lookahead,
                            self.block_size, self.hash_lookahead)
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
            req.block_ids.append(b)
            if not self.has_drafter_kv[b]:
                req.drafter_start = len(req.block_ids) * self.block_size
        req.num_cached_blocks = len(req.block_ids)
        return len(req.block_ids) * self.block_size

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """An admitted request looked up ``num_tokens`` tokens and found ``num_hit_tokens`` cached."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_blocks(self, req: Request, num_valid_tokens: int) -> None:
        """Register ``req``'s full blocks within its first ``num_valid_tokens`` tokens (their target
        KV written, their drafter KV settled), each noting whether its drafter KV is written: from
        ``req.drafter_start`` on. A block whose hash another block already holds stays
        unregistered (two requests computed the same prefix at once) and is freed as an ordinary
        block, unless it has the drafter KV the registered one lacks: then it takes its place."""
        if not self.enable_caching:
            return
        full = min(num_valid_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:
            return
        extend_block_hashes(req.block_hashes, req.all_token_ids, req.num_tokens, self.block_size, self.hash_lookahead)
        full = min(full, len(req.block_hashes))
        for i in range(req.num_cached_blocks, full):
            h, b = req.block_hashes[i], req.block_ids[i]
            if self.block_hashes[b] is not None:  # taken from the cache
                continue
            with_drafter = i * self.block_size >= req.drafter_start
            old = self.cached.get(h)
            if old is not None and (self.has_drafter_kv[old] or not with_drafter):
                continue
            if old is not None:  # b has the drafter KV old lacks: old becomes an ordinary block
                self.block_hashes[old] = None
                if self.ref_counts[old] == 0:
                    del self.evictable[old]
                    heapq.heappush(self.free_blocks, old)
            self.cached[h] = b
            self.block_hashes[b] = h
            self.has_drafter_kv[b] = with_drafter
        req.num_cached_blocks = max(req.num_cached_blocks, full)
