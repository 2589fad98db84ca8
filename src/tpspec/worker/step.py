"""What the driver sends every rank for one engine step, and what comes back (host-side, picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpspec.sampling_params import SamplingParams


@dataclass
class SeqStep:
    """One sequence's share of a step: feed ``token_ids`` at positions ``start_pos…``; the last
    ``num_spec`` of them are draft tokens to verify. If ``sample``, emit the verified tokens and
    the one that follows them."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    seed: int
    num_spec: int = 0


@dataclass
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
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
    drafts: list[list[int]] = field(default_factory=list)  # next drafts from a model-based speculator
