"""What the driver sends every rank for one engine step, and what comes back (host-side, picklable).

The ranks keep each running request's tokens, block table and pending drafts themselves
(``worker.request_state``), so a step carries only what changed: a new request's prompt once, then
per scheduled request how many of its tokens to feed, the blocks added since the last step, how
many of its drafts to verify and how many to propose next. Token ids and counts come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpspec.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """Sent once, in the first step that schedules the request."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # effective: sampling_params.max_tokens capped by max_model_len
    eos_token_ids: frozenset[int]


@dataclass
class SeqStep:
    """One request's share of a step: feed its tokens ``start_pos … start_pos + num_new_tokens − 1``
    plus the first ``num_spec`` drafts the ranks hold for it. When that reaches its last token,
    emit the verified drafts and the token after them, then propose ``num_draft`` drafts."""

    req_id: str
    start_pos: int  # tokens already in the KV cache (cached blocks a new request took included)
    num_new_tokens: int
    new_block_ids: list[int]  # appended to the request's block table
    num_spec: int = 0
    num_draft: int = 0
    restart: bool = False  # recomputed after a preemption: the block table and the drafter's state start over
    # Set in the step that first schedules the request or restarts it: the first position whose
    # drafter KV its cached blocks hold, through to ``start_pos`` (0: all of them, or none taken).
    drafter_start: int | None = None


@dataclass
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # ended since the last step: drop their state


@dataclass
class TokenLogprobs:
    token_logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class StepOutput:
    """Per scheduled sequence, in order."""

    sampled: list[list[int]]  # accepted drafts + one recovered/bonus token ([] for a partial prefill chunk)
    logprobs: list[list[TokenLogprobs] | None]  # per emitted token, if the request asked for them
    num_accepted: list[int] = field(default_factory=list)  # accepted drafts per sequence
    num_drafts: list[int] = field(default_factory=list)  # drafts the ranks now hold per sequence
    # Per sequence: how many of its latest computed tokens the drafter has not fed yet (its
    # deferred feed; their KV blocks are not registered for prefix caching until it has fed or
    # dropped them), and the first position whose drafter KV its drafting reads (``DraftState``).
    drafter_lag: list[int] = field(default_factory=list)
    drafter_start: list[int] = field(default_factory=list)
    target_s: float = 0.0  # rank 0's time in the target's forward, LM head and verification
    drafter_s: float = 0.0  # rank 0's time in the drafter
    drafter_fed_rows: int = 0  # rows rank 0's drafter fed (its deferred backlogs included)
