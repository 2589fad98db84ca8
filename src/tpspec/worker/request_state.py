"""What every rank keeps per running request between steps, as vLLM's Model Runner V2 does: its
tokens, block table, sampling parameters and stop conditions (the drafts proposed for its next
step are the speculator's, ``spec_decode.speculator.DraftState``). The driver sends only changes
(``worker.step``); a rank forgets a request when its own stop check ends it (EOS, stop token,
max_tokens) or when the driver lists it as finished (stop string, abort) in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpspec.sampling_params import SamplingParams
from tpspec.worker.step import NewRequest, SeqStep


class TokenSequence:
    """A request's tokens, prompt then output: what the driver's ``Request`` and the rank's
    ``RankRequest`` both read (they keep ``prompt_token_ids`` and ``output_token_ids``)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]


@dataclass
class RankRequest(TokenSequence):
    """The rank's own record of a request."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or the one the engine drew for it
    max_tokens: int  # effective: sampling_params.max_tokens capped by max_model_len
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_new(cls, new: NewRequest) -> "RankRequest":
        return cls(new.req_id, list(new.prompt_token_ids), new.params, new.seed, new.max_tokens, new.eos_token_ids)

    def append(self, token_id: int) -> bool:
        """Append an output token; whether it ends the request (``SamplingParams.stop_for_token``)."""
        self.output_token_ids.append(token_id)
        return self.params.stop_for_token(token_id, self.eos_token_ids, len(self.output_token_ids),
                                          self.max_tokens) is not None


@dataclass
class ScheduledSeq:
    """One request's share of the current step, resolved against the rank's records."""

    step: SeqStep
    req: RankRequest
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
        return self.req.block_ids

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def seed(self) -> int:
        return self.req.seed


class RequestStates:
    """The rank's records of its running requests, by id."""

    def __init__(self) -> None:
        self.requests: dict[str, RankRequest] = {}

    def add(self, new: NewRequest) -> None:
        self.requests[new.req_id] = RankRequest.from_new(new)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def schedule(self, seqs: list[SeqStep]) -> list[RankRequest]:
        """The step's requests in order, their block changes applied (a sequence recomputed after a
        preemption starts its block table over)."""
        reqs = []
        for s in seqs:
            req = self.requests[s.req_id]
            if s.restart:
                req.block_ids = []
            req.block_ids.extend(s.new_block_ids)
            reqs.append(req)
        return reqs

    @staticmethod
    def append(req: RankRequest, tokens: list[int]) -> bool:
        """Append a step's emitted tokens the way the driver does (up to a stop); returns whether the
        request ended (the runner then forgets it)."""
        return any(req.append(token) for token in tokens)

    def __len__(self) -> int:
        return len(self.requests)
