"""The shapes of the start-up step-time profile, which every rank runs (``ModelRunner.profile_step_time``,
the drafters' ``dummy_feed``/``dummy_pass``) and the driver's ``StepTimeModel`` reads."""

from __future__ import annotations

# Profiled sequences attend to this many earlier tokens (attention's share of a step grows with
# the context: a profile over empty contexts would underrate verifying drafts).
PROFILE_CONTEXT = 256


def profile_context(max_model_len: int, num_slots: int, query_len: int) -> int:
    """Earlier tokens each profiled sequence attends to: ``PROFILE_CONTEXT``, less where
    max_model_len or the KV cache leaves less room."""
    return max(0, min(PROFILE_CONTEXT, max_model_len - query_len, num_slots - query_len))


def profile_grid(max_rows: int) -> list[int]:
    """Row counts to profile: 1, 2, 4, 8, 16, then powers of two and the midpoints between them
    (24, 32, 48, 64, 96, …; costs bend where kernels change, e.g. past the oneDNN layers' rows)
    up to ``max_rows``, and ``max_rows`` itself."""
    points = [1, 2, 4, 8] + [m << i for i in range(3, 30) for m in (2, 3)]  # …, 16, 24, 32, 48, 64, 96, …
    return [x for x in points if x < max_rows] + [max_rows]
