"""Prefix caching's bookkeeping, with no model: the hash chain, which blocks a request takes from
the cache, reference counts under sharing, LRU eviction order, registration that waits for the
drafter, and preemption with cached blocks."""

from __future__ import annotations

from tpspec.config import SchedulerConfig
from tpspec.engine.block_hash import ROOT_HASH, block_hash, extend_block_hashes
from tpspec.engine.kv_cache import BlockManager
from tpspec.engine.scheduler import Scheduler
from tpspec.engine.sequence import Request
from tpspec.sampling_params import SamplingParams
from tpspec.worker.step import StepOutput

BS = 4


def _request(req_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens), 0, max_tokens, frozenset({2}))


def _hashes(tokens: list[int], lookahead: int = 0) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, len(tokens), BS, lookahead)
    return out


def test_the_hash_chain_follows_every_token_upstream():
    tokens = list(range(100, 117))  # 4 full blocks and one token
    h = _hashes(tokens)
    assert len(h) == 4 and len(set(h)) == 4
    assert h == _hashes(list(tokens))  # same tokens, same hashes
    assert h[0] == block_hash(ROOT_HASH, tokens[:4]) and h[1] == block_hash(h[0], tokens[4:8])
    for pos in (0, 5, 15):  # a change in block b changes b's hash and every one after it
        changed = list(tokens)
        changed[pos] += 1
        g = _hashes(changed)
        b = pos // BS
        assert g[:b] == h[:b] and all(x != y for x, y in zip(g[b:], h[b:]))
    # The same block under another parent hashes differently.
    assert block_hash(ROOT_HASH, tokens[4:8]) != h[1]


def test_a_lookahead_hash_covers_the_token_after_the_block():
    tokens = list(range(100, 117))
    h = _hashes(tokens, lookahead=1)
    assert len(h) == 4  # block 3 needs token 16: there
    assert len(_hashes(tokens[:16], lookahead=1)) == 3  # no token after block 3 yet
    changed = tokens[:8] + [999] + tokens[9:]  # the first token of block 2
    g = _hashes(changed, lookahead=1)
    assert g[0] == h[0] and g[1] != h[1]  # block 1's hash covers it
    assert _hashes(changed)[1] == _hashes(tokens)[1]  # without the lookahead it does not


def _computed(manager: BlockManager, req: Request) -> None:
    """``req`` admitted, its prompt computed and registered."""
    hit = manager.take_cached(req)
    assert manager.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    manager.cache_blocks(req, req.num_tokens)
    return hit


def test_a_request_takes_the_blocks_its_tokens_start_with_but_never_its_last_token():
    manager = BlockManager(32, BS, enable_caching=True)
    a = _request("a", list(range(100, 114)))  # 3 full blocks + 2 tokens
    assert _computed(manager, a) == 0
    assert manager.num_cached_blocks == 3
    b = _request("b", list(range(100, 112)) + [7, 8, 9])  # the same 3 blocks, then its own
    assert manager.take_cached(b) == 12 and b.block_ids == a.block_ids[:3]
    c = _request("c", list(range(100, 112)))  # exactly the 3 blocks: the last token is computed
    assert manager.take_cached(c) == 8 and c.block_ids == a.block_ids[:2]
    d = _request("d", [100] + list(range(101, 112)))
    d.prompt_token_ids[5] = 0  # differs in block 1
    assert manager.take_cached(d) == 4
    off = BlockManager(32, BS)
    e = _request("e", list(range(100, 114)))
    assert _computed(off, e) == 0 and off.num_cached_blocks == 0
    assert off.take_cached(_request("f", list(range(100, 114)))) == 0


def test_shared_blocks_are_counted_and_never_evicted_while_referenced():
    manager = BlockManager(6, BS, enable_caching=True)
    a = _request("a", list(range(100, 113)))  # 3 full blocks + 1 token: 4 blocks
    _computed(manager, a)
    b = _request("b", list(range(100, 113)))
    assert manager.take_cached(b) == 12
    shared = a.block_ids[:3]
    assert [manager.ref_counts[x] for x in shared] == [2, 2, 2]
    assert manager.allocate(b, 13) and manager.num_free_blocks == 1
    manager.free(a)
    assert [manager.ref_counts[x] for x in shared] == [1, 1, 1]  # b holds them: not evictable
    assert manager.num_free_blocks == 2  # a's own last block
    c = _request("c", list(range(200, 212)))
    assert not manager.allocate(c, 12)  # 3 blocks needed, 2 free: nothing b references is taken
    assert manager.allocate(c, 8) and not set(c.block_ids) & set(b.block_ids)
    manager.free(b)
    manager.free(c)
    assert manager.num_free_blocks == 6 and all(r == 0 for r in manager.ref_counts)


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_freed_tail_first():
    manager = BlockManager(8, BS, enable_caching=True)
    a = _request("a", list(range(100, 109)))  # 2 full blocks + 1 token
    b = _request("b", list(range(200, 209)))
    _computed(manager, a)
    _computed(manager, b)
    a_full, b_full = a.block_ids[:2], b.block_ids[:2]
    manager.free(a)  # freed first: evicted first, its tail block before its head
    manager.free(b)
    assert manager.num_cached_blocks == 4 and manager.num_free_blocks == 8
    evicted_order = []
    c = _request("c", list(range(300, 332)))
    for n in range(1, 9):
        assert manager.allocate(c, n * BS)
        evicted_order += [x for x in a_full + b_full if x in c.block_ids and x not in evicted_order]
    # The 2 never-cached blocks (a's and b's partial last blocks) and the 2 untouched ones first.
    assert evicted_order == [a_full[1], a_full[0], b_full[1], b_full[0]]
    assert manager.num_cached_blocks == 0
    assert manager.take_cached(_request("a2", list(range(100, 109)))) == 0


def test_blocks_wait_for_the_drafter_before_they_are_registered():
    manager = BlockManager(16, BS, enable_caching=True)
    a = _request("a", list(range(100, 117)))
    manager.allocate(a, 17)
    a.num_computed_tokens = 17
    manager.cache_blocks(a, 17 - 10)  # the drafter has not fed the last 10: only block 0 is whole
    assert manager.num_cached_blocks == 1
    assert manager.take_cached(_request("b", list(range(100, 117)))) == 4
    manager.cache_blocks(a, 17)
    assert manager.num_cached_blocks == 4


def test_blocks_without_drafter_kv_start_a_takers_drafter_context_after_them():
    """A held request's drafter let its first 8 positions go (``drafter_start`` 8): its blocks 0
    and 1 are registered without drafter KV. A taker of them starts its drafter context after the
    last such block it takes; a later request that computed the same blocks with drafter KV takes
    their place in the cache."""
    manager = BlockManager(16, BS, enable_caching=True)
    tokens = list(range(100, 117))
    held = _request("held", tokens)
    manager.allocate(held, 17)
    held.num_computed_tokens, held.drafter_start = 17, 8
    manager.cache_blocks(held, 16)
    assert manager.num_cached_blocks == 4
    taker = _request("taker", tokens)
    assert manager.take_cached(taker) == 16 and taker.drafter_start == 8
    short = _request("short", tokens[:6] + [1, 2, 3])
    assert manager.take_cached(short) == 4 and short.drafter_start == 4
    partial = _request("partial", tokens[:8] + [1, 2, 3])
    assert manager.take_cached(partial) == 8 and partial.drafter_start == 8
    full = _request("full", tokens)  # computed itself (nothing taken), its drafter KV written throughout
    manager.allocate(full, 17)
    full.num_computed_tokens = 17
    manager.cache_blocks(full, 16)
    assert manager.num_cached_blocks == 4
    fresh = _request("fresh", tokens)
    assert manager.take_cached(fresh) == 16 and fresh.drafter_start == 0
    assert fresh.block_ids[:2] == full.block_ids[:2] and fresh.block_ids[2:] == held.block_ids[2:4]
    for req in (held, taker, short, partial, full, fresh):
        manager.free(req)
    assert manager.num_free_blocks == 16 and manager.num_cached_blocks == 4


def _scheduler(num_blocks: int, **config) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 64, "max_model_len": 64, "max_num_seqs": 8, **config})
    return Scheduler(config, BlockManager(num_blocks, BS, enable_caching=True))


def _step(sched: Scheduler, lag: int = 0, drafter_start: int = 0):
    """One step; returns the scheduler's output and what it told the ranks."""
    out = sched.schedule()
    n = len(out.requests)
    step = out.step_input([0] * n, [0] * n)
    sampled = [[5] if out.samples(i) else [] for i in range(n)]
    sched.update(out, StepOutput(sampled, [None] * n, [0] * n, [0] * n, [lag] * n, [drafter_start] * n))
    return out, step


def test_the_scheduler_computes_only_what_is_not_cached_and_counts_queries_and_hits():
    sched = _scheduler(32)
    sched.add_request(_request("a", list(range(100, 118))))
    out, _ = _step(sched)
    assert out.num_new_tokens == [18]
    sched.add_request(_request("b", list(range(100, 116)) + [1, 3, 5]))
    out, step = _step(sched)
    assert out.num_new_tokens == [1, 3]  # a decodes; b computes its 3 own tokens after 16 cached
    assert step.seqs[1].start_pos == 16 and step.new_requests[0].req_id == "b"
    assert len(step.seqs[1].new_block_ids) == 5  # the ranks get the cached blocks in b's table too
    bm = sched.block_manager
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (18 + 19, 16)


def test_a_lagging_drafter_holds_blocks_back_until_its_request_ends():
    sched = _scheduler(32)
    a = _request("a", list(range(100, 118)), max_tokens=2)
    sched.add_request(a)
    _step(sched, lag=18)  # the drafter put the whole prompt off
    assert sched.block_manager.num_cached_blocks == 0
    _step(sched, lag=0)  # a ends (max_tokens) with its feed settled (fed): its full blocks are cached
    assert a.status.finished and sched.block_manager.num_cached_blocks == 4


def test_a_request_whose_drafter_gave_its_backlog_up_caches_its_blocks_without_drafter_kv():
    """The ranks' drafter gave an ended request's backlog up (``Speculator.settle``: lag 0, its
    context past its computed tokens): its blocks are registered without drafter KV, and the ranks
    learn where a taker's drafter context starts (``SeqStep.drafter_start``, in its first step)."""
    sched = _scheduler(32)
    sched.add_request(_request("a", list(range(100, 118)), max_tokens=2))
    _, step = _step(sched, lag=18)
    assert step.seqs[0].drafter_start == 0 and sched.block_manager.num_cached_blocks == 0
    _step(sched, lag=0, drafter_start=19)  # a ends
    assert sched.block_manager.num_cached_blocks == 4
    sched.add_request(_request("b", list(range(100, 118)) + [7]))
    _, step = _step(sched, drafter_start=16)
    assert (step.seqs[0].start_pos, step.seqs[0].drafter_start) == (16, 16)
    _, step = _step(sched, drafter_start=16)
    assert step.seqs[0].drafter_start is None  # told once


def test_a_preempted_request_takes_its_own_cached_blocks_back_and_restarts_the_ranks_table():
    sched = _scheduler(6, max_num_batched_tokens=16)
    a = _request("a", list(range(100, 112)), max_tokens=20)  # 3 blocks
    b = _request("b", list(range(200, 208)), max_tokens=20)  # 2 blocks
    sched.add_request(a)
    _step(sched)
    sched.add_request(b)
    for _ in range(6):  # a and b decode until the 6 blocks run out: b (admitted last) is preempted
        out, _ = _step(sched)
        if out.num_preempted:
            break
    assert out.num_preempted == 1 and b.restart_table and b.num_computed_tokens == 0
    cached = sched.block_manager.num_hit_tokens
    sched.finish_request("a", a.status)  # room again
    out = sched.schedule()
    i = [r.request_id for r in out.requests].index("b")
    assert sched.block_manager.num_hit_tokens - cached == 8  # its 2 full prompt blocks
    seq = out.step_input([0] * len(out.requests), [0] * len(out.requests)).seqs[i]
    assert seq.restart and seq.start_pos == 8 and len(seq.new_block_ids) == len(b.block_ids)
