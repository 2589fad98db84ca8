"""Continuous batching with chunked prefill and preemption by recompute.

Each step gives every running request the tokens it still needs in the KV cache (one for a
decode, a chunk for a prefill) within ``max_num_batched_tokens``, then admits waiting requests
while blocks, sequence slots and the token budget last. When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tpspec.config import SchedulerConfig
from tpspec.engine.kv_cache import BlockManager
from tpspec.engine.sequence import Request, RequestStatus
from tpspec.worker.step import SeqStep, StepInput, StepOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def step_input(self) -> StepInput:
        seqs = []
        for req, n in zip(self.requests, self.num_new_tokens):
            start = req.num_computed_tokens
            seqs.append(
                SeqStep(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids[start : start + n],
                    start_pos=start,
                    block_table=list(req.block_ids),
                    sample=start + n == req.num_tokens,
                    params=req.sampling_params,
                    seed=req.seed,
                )
            )
        return StepInput(seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error): free its blocks and forget it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.status.finished:
            req.status = status
        self.block_manager.free(req)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: nothing behind it is left either
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        if out.num_preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not self.block_manager.allocate(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def update(self, out: SchedulerOutput, result: StepOutput) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that gained tokens or finished."""
        touched = []
        for req, n, token in zip(out.requests, out.num_new_tokens, result.sampled):
            if req.status.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if token is None:
                continue
            req.output_token_ids.append(token)
            touched.append(req)
            if req.check_stop(token):
                self.finish_request(req.request_id, req.status)
        return touched
