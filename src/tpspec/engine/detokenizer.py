"""Incremental detokenization with stop strings, for streaming.

Text comes from decoding a short window of trailing tokens (the prefix/read-offset technique):
``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])`` is the text the tokens after ``read``
add. While that text ends in U+FFFD (a UTF-8 character split across tokens) only the characters
before it are taken and the window grows until the character completes; then the window slides
forward. Work per token is O(window), independent of the output length.

Stop strings are matched against the decoded text. The first stop string to *complete*, reading
the text left to right, wins (among several completing at the same character, the longest), so
the result does not depend on how the text was split into tokens. Without
``include_stop_str_in_output``, text that might be the start of a stop string is held back from
the deltas until the next characters resolve it, so a streaming client never sees any part of a
stop string: every delta is a prefix-extension of the final output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tpspec.sampling_params import SamplingParams

# Prompt tokens decoded along with the first output tokens, for decoders whose output depends on
# the preceding token (e.g. a SentencePiece leading space).
INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas, stopping at stop strings."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: tuple[str, ...] = params.stop  # normalised to a tuple by SamplingParams
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        self._ids = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._prefix = max(self._num_prompt - INITIAL_PREFIX_TOKENS, 0)
        self._read = self._num_prompt
        # A prompt ending inside a UTF-8 character: its last tokens wait for the output to finish
        # that character, which then opens the first delta.
        while self._read > self._prefix and self._decode(self._prefix, self._read).endswith(
            _REPLACEMENT
        ):
            self._read -= 1

        self._emitted: list[str] = []  # deltas returned so far
        self._context = ""  # last (max_stop_len - 1) emitted characters, for matches that span them
        self._held = ""  # decoded text not yet returned: a possible start of a stop string
        self._beyond_read = 0  # characters taken from text after the read offset (split char)
        self._text_cache: str | None = ""
        self._finished_by_stop: str | None = None
        self._flushed = False

    @property
    def finished_by_stop(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._finished_by_stop

    @property
    def output_text(self) -> str:
        """All text so far: the returned deltas plus any held-back text (truncated at a stop)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._emitted) + self._held
        return self._text_cache

    @property
    def num_output_tokens(self) -> int:
        """Output tokens consumed; tokens after the one that completed a stop string are dropped."""
        return len(self._ids) - self._num_prompt

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Consume new output tokens; return the text newly safe to stream.

        Stops consuming at the token whose text completes a stop string (see
        ``num_output_tokens``).
        """
        if self._finished_by_stop is not None or self._flushed:
            raise RuntimeError("update() called on a detokenizer whose output has already ended")
        delta = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            text = self._next_text()
            if text:
                delta.append(self._absorb(text))
                if self._finished_by_stop is not None:
                    break
        return "".join(delta)

    def flush(self) -> str:
        """End the output (call once, when the request finishes); return what is still held back.

        That is the held-back start of a stop string and the text of trailing tokens that never
        formed a complete character (U+FFFD, as a full decode shows them). After a stop string
        nothing is held back and this returns "".
        """
        if self._flushed:
            raise RuntimeError("flush() called twice")
        self._flushed = True
        if self._finished_by_stop is not None:
            return ""
        start = len(self._decode(self._prefix, self._read)) + self._beyond_read
        tail = self._decode(self._prefix, len(self._ids))[start:]
        delta = self._absorb(tail) if tail else ""
        if self._finished_by_stop is None:
            delta += self._emit(self._held)
            self._held = ""
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _next_text(self) -> str:
        """Text the newest token completes; a character still split across tokens waits."""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        start = len(prefix_text) + self._beyond_read
        if new_text.endswith(_REPLACEMENT):
            # The characters before the split one are final: take them, keep the window.
            stable = new_text.rstrip(_REPLACEMENT)
            if len(stable) <= start:
                return ""
            self._beyond_read = len(stable) - len(prefix_text)
            return stable[start:]
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: keep the window for context
        self._prefix, self._read, self._beyond_read = self._read, len(self._ids), 0
        return new_text[start:]

    def _absorb(self, text: str) -> str:
        """Add decoded text; check stop strings; return the part that is safe to stream."""
        if not self._stops:
            return self._emit(text)
        window = self._context + self._held + text
        searched = len(self._context) + len(self._held)  # matches ending before here were checked
        match = self._first_stop(window, searched)
        if match is not None:
            start, stop = match
            self._finished_by_stop = stop
            cut = start + len(stop) if self._include_stop else start
            self._held = ""
            return self._emit(window[len(self._context):cut])
        pending = self._held + text
        hold = 0 if self._include_stop else self._stop_prefix_len(pending)
        self._held = pending[len(pending) - hold:]
        return self._emit(pending[: len(pending) - hold])

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
            keep = self._max_stop_len - 1
            self._context = (self._context + text)[-keep:] if keep > 0 else ""
        self._text_cache = None
        return text

    def _first_stop(self, window: str, searched: int) -> tuple[int, str] | None:
        """(start, stop string) of the match completing first after ``searched``, or None."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = window.find(stop, max(searched - len(stop) + 1, 0))
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
