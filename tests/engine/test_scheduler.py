"""The scheduler alone, with no model: chunked prefill within the token budget, decodes first,
the drafter's lookahead reserved, preemption by recompute, stops inside a step's tokens, and
what each step tells the ranks (a new request once, only new blocks, ended requests)."""

from __future__ import annotations

from tpspec.config import SchedulerConfig
from tpspec.engine.kv_cache import BlockManager
from tpspec.engine.scheduler import Scheduler
from tpspec.engine.sequence import Request, RequestStatus
from tpspec.sampling_params import SamplingParams
from tpspec.worker.step import StepOutput

EOS = 2


def _request(req_id: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(req_id, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0, max_tokens,
                   frozenset({EOS}))


def _scheduler(num_blocks=64, block_size=4, lookahead=0, **config) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_model_len": 128, "max_num_seqs": 8, **config})
    return Scheduler(config, BlockManager(num_blocks, block_size), lookahead)


def _step(sched: Scheduler, tokens: dict[str, list[int]] | None = None, drafts: int = 0):
    """One step: the scheduler's choice, then each sampling request emits its token(s)."""
    out = sched.schedule()
    tokens = tokens or {}
    sampled = [tokens.get(r.request_id, [5]) if out.samples(i) else [] for i, r in enumerate(out.requests)]
    touched = sched.update(out, StepOutput(sampled, [None] * len(sampled), [0] * len(sampled), [drafts] * len(sampled)))
    return out, touched


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched = _scheduler()
    req = _request("a", 40)
    sched.add_request(req)
    chunks, emitted = [], []
    for _ in range(4):
        out, touched = _step(sched)
        chunks.append(out.num_new_tokens[0])
        emitted.append(sum(n for _, n in touched))
    assert chunks == [16, 16, 8, 1]  # the last chunk reaches the prompt's end, then one decode
    assert emitted == [0, 0, 1, 1]  # a token only once the whole prompt is in the cache
    assert req.num_computed_tokens == 41


def test_decodes_go_first_and_waiting_requests_share_what_is_left():
    sched = _scheduler()
    sched.add_request(_request("a", 4))
    _step(sched)  # a's prefill, and its first token
    sched.add_request(_request("b", 30))
    out, _ = _step(sched)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [1, 15]  # a's decode, then b's first chunk within the 16-token budget


def test_the_drafters_lookahead_is_reserved_with_the_tokens():
    sched = _scheduler(block_size=4, lookahead=5)
    req = _request("a", 6)
    sched.add_request(req)
    _step(sched)
    assert len(req.block_ids) == 3  # 6 prompt tokens + 5 lookahead slots = 11 -> 3 blocks of 4


def test_out_of_blocks_preempts_the_newest_request_and_recomputes_it():
    sched = _scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, b = _request("a", 7, max_tokens=8), _request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, drafts=2)  # both prefilled: 2 blocks each, the pool is full
    assert a.num_spec_tokens == 2
    out, _ = _step(sched)  # a's decode needs a third block: b, the newest, is preempted
    assert out.num_preempted == 1 and [r.request_id for r in out.requests] == ["a"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_spec_tokens == 0  # its drafts on the ranks are gone with the recompute
    assert sched.waiting[0] is b and len(b.output_token_ids) == 1  # its token is kept, recomputed from 0
    while sched.has_unfinished():
        _step(sched)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert sched.block_manager.num_free_blocks == 4


def test_a_stop_inside_a_steps_tokens_keeps_nothing_after_it_and_frees_the_request():
    sched = _scheduler()
    req = _request("a", 4)
    sched.add_request(req)
    _step(sched)
    _, touched = _step(sched, tokens={"a": [7, EOS, 8, 9]})  # accepted drafts, EOS in the middle
    assert req.output_token_ids == [5, 7, EOS] and touched == [(req, 2)]
    assert req.status == RequestStatus.FINISHED_STOPPED and sched.block_manager.num_free_blocks == 64
    sched.add_request(_request("b", 4))
    out = sched.schedule()
    assert out.step_input([0], [0]).finished_req_ids == ["a"]  # the ranks drop a's state with the next step


def test_the_ranks_get_a_new_request_once_and_only_new_blocks():
    sched = _scheduler(block_size=4)
    sched.add_request(_request("a", 6))
    inputs = []
    for _ in range(4):  # the prefill (6 tokens), then decodes of tokens 7, 8 and 9
        out = sched.schedule()
        inputs.append(out.step_input([0], [0]))
        sched.update(out, StepOutput([[5]], [None], [0], [0]))
    assert [[n.req_id for n in i.new_requests] for i in inputs] == [["a"], [], [], []]
    assert [i.seqs[0].new_block_ids for i in inputs] == [[0, 1], [], [], [2]]  # token 9 opens block 2
    assert [i.seqs[0].start_pos for i in inputs] == [0, 6, 7, 8]
