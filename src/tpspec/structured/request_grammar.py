"""One request's grammar on a rank: its xgrammar matcher, kept at the request's committed output.

Every rank follows the same tokens, so every rank's matcher gives the same masks and no mask
crosses the wire (docs/structured-outputs.md has the measurement behind that choice).

A step reads masks three ways:
  * verification (and plain sampling): ``verify_masks(num_spec)``, the masks of the held drafts'
    positions and the one after them, computed when the drafts were proposed;
  * committing: ``accept(tokens)`` advances the matcher over the emitted tokens;
  * drafting: ``draft_mask()`` then ``draft(token)`` per draft position, tentatively; ``settle``
    then holds the drafter's drafts up to the first one the grammar forbids (n-gram drafts are
    checked there only), with their masks, and rolls the matcher back to the committed output.

Masks are int32 rows, token t at bit ``t % 32`` of word ``t // 32`` (``sample.token_bitmask``).
"""

from __future__ import annotations

import torch


def is_allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether ``mask`` ([words] int32) allows ``token``."""
    return 0 <= token < 32 * mask.shape[0] and bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class RequestGrammar:
    def __init__(self, matcher, words: int, stop_token_ids: list[int]) -> None:
        self.matcher = matcher  # xgrammar.GrammarMatcher at the committed output (between steps)
        self.words = words  # int32 words per mask row
        self.stop_token_ids = stop_token_ids
        self._drafted: list[int] = []  # tokens accepted tentatively while drafting
        self._masks: list[torch.Tensor] = []  # [words] mask at each tentative position
        self._held: torch.Tensor | None = None  # [held drafts + 1, words] masks for verifying the held drafts

    def _stop_only(self) -> torch.Tensor:
        """The mask once the grammar is complete (only seen with ``ignore_eos``): a stop token only."""
        ids = torch.tensor([t for t in self.stop_token_ids if 0 <= t < 32 * self.words], dtype=torch.int64)
        words = torch.zeros(self.words, dtype=torch.int64).index_add_(0, ids >> 5, 1 << (ids & 31))
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def _mask_now(self) -> torch.Tensor:
        if self.matcher.is_terminated():
            return self._stop_only()
        row = torch.empty(1, self.words, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        return row[0]

    # ---- verification and commit ----------------------------------------------------------
    def verify_masks(self, num_spec: int) -> torch.Tensor:
        """The masks of the positions verified with ``num_spec`` of the held drafts:
        ``[num_spec + 1, words]`` int32."""
        if self._held is not None and self._held.shape[0] > num_spec:
            return self._held[: num_spec + 1]
        if num_spec:
            raise RuntimeError(f"asked to verify {num_spec} drafts under a grammar that holds none")
        return self._mask_now().unsqueeze(0)

    def accept(self, tokens: list[int]) -> None:
        """Advance over emitted tokens (each allowed by the mask it was sampled under)."""
        self._held = None
        for t in tokens:
            if self.matcher.is_terminated():
                return  # stop tokens past the end (ignore_eos) change nothing
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"the grammar rejected emitted token {t}")

    # ---- drafting -----------------------------------------------------------------------------
    def draft_mask(self) -> torch.Tensor:
        """The mask of the next draft position (after the drafts accepted so far): [words] int32."""
        if len(self._masks) == len(self._drafted):
            self._masks.append(self._mask_now())
        return self._masks[-1]

    def draft(self, token: int) -> bool:
        """Accept a draft tentatively; False (and nothing accepted) if the grammar forbids it."""
        if (self.matcher.is_terminated() or not is_allowed(self.draft_mask(), token)
                or not self.matcher.accept_token(token)):
            return False
        self._drafted.append(token)
        return True

    def settle(self, drafts: list[int]) -> int:
        """Hold ``drafts`` for the next step up to the first the grammar forbids, with the masks
        of their positions and the one after; roll the matcher back to the committed output.
        Returns how many drafts are held."""
        same = 0
        while same < min(len(drafts), len(self._drafted)) and drafts[same] == self._drafted[same]:
            same += 1
        if same < len(self._drafted):  # the drafter kept fewer drafts than it tried
            self.matcher.rollback(len(self._drafted) - same)
            del self._drafted[same:]
            del self._masks[same + 1 :]
        for t in drafts[same:]:
            if not self.draft(t):
                break
        held = len(self._drafted)
        self.draft_mask()
        self._held = torch.stack(self._masks)
        if held:
            self.matcher.rollback(held)
        self._drafted, self._masks = [], []
        return held
