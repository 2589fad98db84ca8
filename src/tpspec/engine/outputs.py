"""What the engine hands back per request (shaped like vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Per generated token, {token id: logprob} of the top alternatives (plus the sampled one);
    # None unless the request asked for logprobs.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Increment since the previous output of this request (for streaming).
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
