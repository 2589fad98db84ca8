"""``method: ngram``: prompt lookup decoding, no draft model.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, look for the most recent earlier
occurrence of the sequence's last n tokens and propose the (up to k) tokens that followed it.
The first n that matches wins, so longer matches take precedence. Earlier occurrences may
overlap the suffix itself (``a a a`` proposes ``a``...), and the proposal is cut at the end of
the sequence rather than padded.

vLLM's ``NgramProposer`` uses the same longest-n-first rule but, among equally long matches,
takes the earliest occurrence; this one takes the most recent, which tends to follow the
sequence's latest local pattern.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpspec.spec_decode.speculator import DraftInput, DraftState, Speculator


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        _check_positive_int("prompt_lookup_min", prompt_lookup_min)
        _check_positive_int("prompt_lookup_max", prompt_lookup_max)
        _check_positive_int("num_speculative_tokens", num_speculative_tokens)
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({prompt_lookup_min}), got {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int | None = None) -> list[int]:
        """Up to ``num_tokens`` (default ``num_speculative_tokens``) draft tokens continuing
        ``token_ids``; [] if no match."""
        num_tokens = self.num_speculative_tokens if num_tokens is None else num_tokens
        tokens = np.asarray(token_ids, dtype=np.int64)  # [length]
        length = tokens.shape[0]
        if length < self.prompt_lookup_min + 1:
            return []
        # Candidate starts: every earlier position holding the suffix's last token, newest first.
        # The occurrence of an n-gram starting at s ends at s + n - 1 <= length - 2.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])[::-1]  # [m] end index of a 1-gram match
        if ends.size == 0:
            return []
        # match_len[e] = how many tokens, backwards from e and from the last token, agree (capped).
        match_len = np.zeros(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(self.prompt_lookup_max):
            idx = ends - back
            ok = alive & (idx >= 0)
            ok[ok] = tokens[idx[ok]] == tokens[length - 1 - back]
            match_len += ok
            alive = ok
            if not alive.any():
                break
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            hits = np.flatnonzero(match_len >= n)
            if hits.size:
                start = int(ends[hits[0]]) + 1  # newest occurrence: ends are sorted newest first
                return tokens[start:start + num_tokens].tolist()
        return []


class NgramSpeculator(Speculator):
    """Prompt lookup on every rank, from each rank's copy of the request's tokens: no model, no
    KV, nothing to feed; proposing is free (the methods table's ``LOOKUP`` drafting)."""

    def __init__(self, spec_config, engine_config, device):
        super().__init__(spec_config, engine_config, device)
        self.proposer = NgramProposer(
            spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, spec_config.num_speculative_tokens
        )

    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        for i in inp.proposing:
            states[i].draft_ids = self.proposer.propose(inp.all_token_ids(i), inp.num_drafts[i])
        return 0
