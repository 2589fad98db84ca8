"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tpspec.sampling_params import SamplingParams
from tpspec.worker.request_state import TokenSequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class Request(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the request's own seed, or one drawn for it by the engine
    max_tokens: int  # effective: sampling_params.max_tokens capped by max_model_len
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Takes each appended output token (the engine's detokenizer); returns the stop string the
    # token's text completed, if any. None: no text is watched.
    on_token: Callable[[int], str | None] | None = field(default=None, repr=False)
    num_spec_tokens: int = 0  # drafts the ranks hold for it, verifiable in its next step
    num_blocks_on_ranks: int = -1  # how many of block_ids the ranks know; -1: the ranks have not seen it
    restart_table: bool = False  # re-admitted after a preemption: the ranks' block table starts over
    # Prefix caching (engine.kv_cache): the hashes of its full blocks so far, how many of its
    # blocks are registered (or were taken from the cache), how many of its latest computed
    # tokens the ranks' drafter has not fed yet (their blocks wait to be registered), and the
    # first position from which its drafter KV is written (below: cached blocks without it, or
    # a backlog the ranks' drafter dropped).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    drafter_lag: int = 0
    drafter_start: int = 0
    wait_for: str | None = None  # a sibling with the same prompt whose prefill this one waits for

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def draft_room(self, max_model_len: int) -> int:
        """How many drafts its next verification could still emit: within max_tokens (one slot is
        the bonus token) and within max_model_len."""
        return max(0, min(self.max_tokens - len(self.output_token_ids) - 1, max_model_len - self.num_tokens))

    def check_stop(self, token_id: int) -> bool:
        """After appending ``token_id``: set a finished status if it ends the request (a stop
        string its text completed, EOS, a stop token id, ``max_tokens``). The scheduler calls
        it for every token and owns the decision: tokens after the one that ends a request are
        never appended."""
        stop = self.on_token(token_id) if self.on_token is not None else None
        if stop is not None:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            return True
        ended = self.sampling_params.stop_for_token(
            token_id, self.eos_token_ids, len(self.output_token_ids), self.max_tokens
        )
        if ended is not None:
            finish_reason, self.stop_reason = ended
            self.status = RequestStatus(finish_reason)
        return self.status.finished
