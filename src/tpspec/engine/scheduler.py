"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step gives every running request the tokens it still needs in the KV cache (one for a
decode, a chunk for a prefill) within ``max_num_batched_tokens``, then admits waiting requests
while blocks, sequence slots and the token budget last; an admitted request first takes the
cached blocks its tokens start with (``BlockManager.take_cached``) and computes only the rest.
After each step, a request's full blocks whose KV is settled are registered for later requests:
the target's is written, and the drafter's written or given up for good (the backlog of a
request held at k = 0 that the ranks' drafter let go, ``Speculator.settle``); each block notes
whether it holds drafter KV (``BlockManager.take_cached`` starts a taker's drafter context after
the last one that does not). When blocks run out, the most recently admitted running request is
preempted: its blocks are freed (the registered ones stay cached) and it is recomputed later.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tpspec.config import SchedulerConfig
from tpspec.engine.kv_cache import BlockManager
from tpspec.engine.sequence import Request, RequestStatus
from tpspec.worker.step import NewRequest, SeqStep, StepInput, StepOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # real (non-draft) tokens fed per request
    max_spec: list[int] = field(default_factory=list)  # most drafts each request may verify (KV reserved for them)
    num_preempted: int = 0
    finished_req_ids: list[str] = field(default_factory=list)

    def samples(self, i: int) -> bool:
        """Whether request i's tokens this step reach its last one (it emits a token)."""
        req = self.requests[i]
        return req.num_computed_tokens + self.num_new_tokens[i] == req.num_tokens

    def step_input(self, num_spec: list[int], num_draft: list[int]) -> StepInput:
        """What the ranks need for this step, given how many drafts each request verifies
        (``num_spec[i]`` <= ``max_spec[i]``) and proposes: only what they have not seen yet."""
        seqs, new = [], []
        for req, n, v, d in zip(self.requests, self.num_new_tokens, num_spec, num_draft):
            if req.num_blocks_on_ranks < 0:
                new.append(NewRequest(req.request_id, req.prompt_token_ids, req.sampling_params, req.seed,
                                      req.max_tokens, req.eos_token_ids))
            restart, req.restart_table = req.restart_table, False
            starts = restart or req.num_blocks_on_ranks < 0
            known = 0 if starts else req.num_blocks_on_ranks
            seqs.append(SeqStep(req.request_id, req.num_computed_tokens, n, req.block_ids[known:], v, d, restart,
                                req.drafter_start if starts else None))
            req.num_blocks_on_ranks = len(req.block_ids)
        return StepInput(seqs, new, self.finished_req_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_lookahead_tokens: int = 0):
        self.config = config
        self.block_manager = block_manager
        # KV slots reserved past a request's scheduled tokens for the drafter's writes.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.finished_req_ids: list[str] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, error, or a stop found by ``update``): free its blocks and forget it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.status.finished:
            req.status = status
        self.block_manager.cache_blocks(req, req.num_computed_tokens - req.drafter_lag)
        self.block_manager.free(req)
        self.finished_req_ids.append(request_id)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.drafter_lag = req.drafter_start = 0  # the ranks drop the drafter's deferred feed
        req.restart_table = req.num_blocks_on_ranks >= 0
        req.num_spec_tokens = 0  # the ranks' drafts are dropped by the recompute
        self.waiting.appendleft(req)

    def _kv_tokens(self, num_tokens: int) -> int:
        """KV slots a request needs for ``num_tokens`` tokens plus the drafter's lookahead. Nothing
        (target or drafter) writes at a position >= max_model_len, so a request never needs more
        than that: one that fits max_model_len always fits an otherwise empty cache."""
        return min(num_tokens + self.num_lookahead_tokens, self.config.max_model_len)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # Drafts ride along with a decode (one real token), as far as the budget and the
            # request's room allow.
            decode = req.num_tokens - req.num_computed_tokens == 1
            spec = min(req.num_spec_tokens, budget - n, req.draft_room(self.config.max_model_len)) if decode else 0
            while not self.block_manager.allocate(req, self._kv_tokens(req.num_computed_tokens + n + spec)):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing behind it is left either
            out.requests.append(req)
            out.num_new_tokens.append(n)
            out.max_spec.append(spec)
            budget -= n + spec
            i += 1
        if out.num_preempted:
            return self._carry_finished(out)
        held = []  # waiting for a sibling's prefill: passed over this step, kept in order
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._waits_for_sibling(req):
                held.append(self.waiting.popleft())
                continue
            hit = self.block_manager.take_cached(req)  # a request waits with nothing computed
            n = req.num_tokens - hit
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    self.block_manager.free(req)
                    break
                n = budget
            if not self.block_manager.allocate(req, self._kv_tokens(hit + n)):
                self.block_manager.free(req)
                break
            if self.block_manager.enable_caching:
                self.block_manager.count_query(req.num_tokens, hit)
            req.num_computed_tokens = hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            out.max_spec.append(0)
            budget -= n
        self.waiting.extendleft(reversed(held))
        return self._carry_finished(out)

    def _waits_for_sibling(self, req: Request) -> bool:
        """Whether ``req`` should wait for the sibling it names (``Request.wait_for``, the first
        choice of an ``n > 1`` request): until that one has computed its prompt, whose blocks it
        then takes from the cache. It stops waiting when the sibling ends."""
        if req.wait_for is None:
            return False
        sibling = self.requests.get(req.wait_for)
        if sibling is None or sibling.num_computed_tokens >= len(sibling.prompt_token_ids):
            req.wait_for = None
            return False
        return True

    def _carry_finished(self, out: SchedulerOutput) -> SchedulerOutput:
        """Requests ended since the last step ride on the next step that runs (the ranks drop
        their state then); while nothing runs they wait here."""
        if out.requests:
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        return out

    def update(self, out: SchedulerOutput, result: StepOutput) -> list[tuple[Request, int]]:
        """Apply a step's verified tokens; returns (request, number of new tokens) for each request
        that gained tokens. The one place a request ends by its output (``Request.check_stop``:
        stop strings, EOS, stop token ids, max_tokens); one that stops inside an accepted run
        keeps no token past the stop."""
        touched = []
        for i, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            if req.status.finished:  # aborted while the step ran
                continue
            accepted = result.num_accepted[i] if result.num_accepted else 0
            req.num_computed_tokens += n + accepted  # KV of rejected drafts is dropped (overwritten later)
            req.num_spec_tokens = result.num_drafts[i] if result.num_drafts else 0
            req.drafter_lag = result.drafter_lag[i] if result.drafter_lag else 0
            req.drafter_start = result.drafter_start[i] if result.drafter_start else 0
            emitted = 0
            for token in result.sampled[i]:
                req.output_token_ids.append(token)
                emitted += 1
                if req.check_stop(token):
                    self.finish_request(req.request_id, req.status)
                    break
            if not req.status.finished:
                self.block_manager.cache_blocks(req, req.num_computed_tokens - req.drafter_lag)
            if emitted:
                touched.append((req, emitted))
        return touched
