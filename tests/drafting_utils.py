"""Driving a speculator directly, as the model runner does: per sequence a request id (added on
first use), one ``propose``, then the drafts it holds."""

from __future__ import annotations

from tpspec.spec_decode.speculator import DraftInput, Speculator


def propose_drafts(spec: Speculator, token_ids, start_pos, block_tables, sampled, num_drafts, sampling=None,
                   target_features=None, req_ids=None) -> list[list[int]]:
    """``DraftInput``'s fields (request ids default to ``seq-i``); returns each sequence's drafts."""
    req_ids = req_ids or [f"seq-{i}" for i in range(len(token_ids))]
    for req_id in req_ids:
        if req_id not in spec.states:
            spec.add(req_id)
    spec.propose(DraftInput(req_ids, token_ids, start_pos, block_tables, sampled, num_drafts, sampling, target_features))
    return [spec.drafts(r) for r in req_ids]
