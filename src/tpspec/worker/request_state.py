"""What every rank keeps per running request between steps, as vLLM's Model Runner V2 does: its
tokens, block table and the drafts proposed for its next step (with their draft distribution q,
for probabilistic drafting). The driver sends only changes (``worker.step``); a rank forgets a
request when its own stop check ends it (EOS, stop token, max_tokens) or when the driver lists it
as finished (stop string, abort) in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpspec.engine.sequence import Request
from tpspec.worker.step import SeqStep, StepInput


@dataclass
class RequestState:
    req: Request  # the rank's copy: prompt and output tokens, sampling params, seed, stop conditions, blocks
    draft_ids: list[int] = field(default_factory=list)  # proposed for the next step
    draft_dists: torch.Tensor | None = None  # [len(draft_ids), width] q of probabilistic drafts
    # The drafter's deferred work on this request's kept tokens (``DraftInput.deferred``); None: none.
    drafter_backlog: object | None = None


@dataclass
class ScheduledSeq:
    """One request's share of the current step, resolved against the rank's state."""

    step: SeqStep
    state: RequestState
    token_ids: list[int]  # fed this step: real tokens, then the drafts being verified
    sample: bool  # the fed tokens reach the request's last token: emit the next ones

    @property
    def req_id(self) -> str:
        return self.step.req_id

    @property
    def start_pos(self) -> int:
        return self.step.start_pos

    @property
    def num_spec(self) -> int:
        return self.step.num_spec

    @property
    def block_table(self) -> list[int]:
        return self.state.req.block_ids

    @property
    def params(self):
        return self.state.req.sampling_params

    @property
    def seed(self) -> int:
        return self.state.req.seed


class RequestStates:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def begin_step(self, step: StepInput) -> list[ScheduledSeq]:
        """Forget finished requests, add new ones, apply block changes; the step's sequences in order."""
        for req_id in step.finished_req_ids:
            self.states.pop(req_id, None)
        for new in step.new_requests:
            req = Request(new.req_id, list(new.prompt_token_ids), new.params, new.seed, new.max_tokens, new.eos_token_ids)
            self.states[new.req_id] = RequestState(req)
        seqs = []
        for s in step.seqs:
            state = self.states[s.req_id]
            req = state.req
            if s.start_pos == 0:  # nothing cached: first chunk, or recomputed after a preemption
                req.block_ids = []
                state.drafter_backlog = None  # its slots may belong to another request by now
            req.block_ids.extend(s.new_block_ids)
            if s.num_spec > len(state.draft_ids):
                raise RuntimeError(
                    f"request {s.req_id!r}: asked to verify {s.num_spec} drafts, the ranks hold {len(state.draft_ids)}"
                )
            end = s.start_pos + s.num_new_tokens
            tokens = req.token_ids_between(s.start_pos, end) + state.draft_ids[: s.num_spec]
            seqs.append(ScheduledSeq(s, state, tokens, sample=end == req.num_tokens))
        return seqs

    def append(self, seq: ScheduledSeq, tokens: list[int]) -> bool:
        """Append a step's emitted tokens the way the driver does (up to a stop); returns whether the
        request ended, in which case the rank forgets it."""
        req = seq.state.req
        for token in tokens:
            req.output_token_ids.append(token)
            if req.check_stop(token):
                self.states.pop(req.request_id, None)
                return True
        return False

    def __len__(self) -> int:
        return len(self.states)

