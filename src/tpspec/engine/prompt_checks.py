"""The checks every prompt passes before it is queued, in one place: the engine (``LLMEngine.add_request``)
and the server (which answers with the OpenAI error's ``param`` and ``code``) both call them."""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """A prompt the engine cannot take. ``param``: the request field at fault; ``code``: the
    OpenAI error code, if it has one."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def check_prompt(ids: Any, vocab_size: int, max_model_len: int, param: str = "prompt") -> list[int]:
    """``ids`` as a list of token ids, if they are ids of the vocabulary, at least one, and leave
    room in ``max_model_len`` for at least one generated token; else ``PromptError``."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PromptError(f"{param} must be a string or a list of token ids", param)
    if not ids:
        raise PromptError(f"{param} is empty: it must contain at least one token", param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"{param} token ids must be in [0, {vocab_size}), got {bad[:3]}", param)
    if len(ids) >= max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, your {param} "
            f"has {len(ids)} tokens, which leaves no room for a completion. Please reduce the length of the {param}.",
            param, code="context_length_exceeded",
        )
    return list(ids)
