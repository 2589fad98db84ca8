"""What the driver sends every rank for one engine step, and what comes back (host-side, picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpspec.sampling_params import SamplingParams


@dataclass
class SeqStep:
    """One sequence's share of a step: feed ``token_ids`` at positions ``start_pos…``; if ``sample``,
    sample the token that follows them."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    seed: int


@dataclass
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)


@dataclass
class TokenLogprobs:
    token_logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class StepOutput:
    """Per scheduled sequence, in order: the sampled token (None for a partial prefill chunk)."""

    sampled: list[int | None]
    logprobs: list[TokenLogprobs | None]
