"""The identity of a full KV block for prefix caching: a hash chain over the tokens.

Block b's hash covers its parent's hash (block b − 1's; a fixed root for block 0) and the token
ids at positions b·B … (b + 1)·B − 1 (B the block size), plus the ``lookahead`` tokens after the
block when the drafter's KV of a position depends on the next token (an EAGLE-3 or MTP head's
row t pairs the target's hidden state at t with token t + 1). Two requests whose first (b + 1)·B
(+ lookahead) tokens are equal get the same hash for block b, and any change upstream changes
every hash after it. Nothing else changes a block's KV in one engine (one model, one drafter, no
adapters), so nothing else goes in. SHA-256, as vLLM's default: a collision would reuse another
prefix's KV.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = hashlib.sha256(b"tpspec prefix cache").digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a block whose parent's hash is ``parent`` and whose tokens (lookahead included)
    are ``token_ids``."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], num_tokens: int, block_size: int,
                        lookahead: int) -> None:
    """Append to ``hashes`` (the hashes of a sequence's first blocks) every further block whose
    tokens and lookahead lie within the first ``num_tokens`` of ``token_ids``."""
    while (len(hashes) + 1) * block_size + lookahead <= num_tokens:
        b = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(block_hash(parent, token_ids[b * block_size : (b + 1) * block_size + lookahead]))
