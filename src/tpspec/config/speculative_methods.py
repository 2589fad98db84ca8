"""The drafting methods, and everything that differs between them, stated once.

A method is one module under ``tpspec/spec_decode`` (its speculator class) plus one row here. The
config (which keys apply, which model it needs), drafter resolution (shipped drafters, the
checkpoint's own checks), the rank's model runner (which speculator to build), the speculation-
length controller and its step-time model (what k drafts cost) all read the row; none of them
names a method. ``register_method`` adds a row (a test's toy method, a user's own drafter).

No torch here: the config's checks read this table before anything heavy is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field

# How a method drafts, which decides what k drafts cost and where its KV writes go:
# CHAIN: pass j (1 … k) drafts token j of every request that wants at least j drafts, each pass
#   one forward over those requests; the drafter writes its own KV at the k positions after the
#   verified tokens (the bonus token's and k − 1 drafts').
# BLOCK: one forward over a block of k + 1 rows per proposing request ([bonus, MASK × k], DFlash),
#   which writes k + 1 KV slots.
# LOOKUP: no drafter forward: drafts are looked up in the request's own tokens; proposing is free
#   and writes no KV.
CHAIN = "chain"
BLOCK = "block"
LOOKUP = "lookup"
DRAFTING_KINDS = (CHAIN, BLOCK, LOOKUP)


@dataclass(frozen=True)
class SpeculativeMethod:
    name: str  # what ``speculative_config.method`` says
    # The rank-side speculator: "package.module:Class" (imported on the ranks, when the engine
    # starts) or the class itself (``register_method`` from code).
    speculator: str | type
    drafting: str  # one of DRAFTING_KINDS
    aliases: tuple[str, ...] = ()
    uses_model: bool = True  # False: no draft checkpoint (``speculative_config.model`` refused)
    # Without ``speculative_config.model``: the target's own checkpoint holds the drafter (MTP
    # layers after its decoder layers, as vLLM reads them).
    model_from_target: bool = False
    # Drafters trained with ``tpspec train-draft`` and shipped in ``tpspec/drafters``, used when
    # the config names no model: the target as given to ``--model`` (None: the default model) ->
    # the drafter's folder name.
    shipped_drafters: Mapping[str | None, str] = field(default_factory=dict)
    # Under ``--quantization q4_1`` the shipped drafters' own weights are rounded to Q4_1
    # (``spec_decode.drafter_rounding``); drafters a user supplies stay as loaded.
    rounds_shipped_drafter_to_q4_1: bool = False
    # Whether a request that proposes nothing this step leaves its kept tokens unfed until it next
    # proposes (the drafter's deferred feed: such a step costs the drafter nothing).
    defers_feed: bool = False
    # Whether the drafter's KV at position t depends on token t + 1 too (a head whose row t pairs
    # the target's hidden state at t with token t + 1): prefix caching then identifies a block by
    # its tokens and the token after it (``engine.block_hash``).
    kv_reads_next_token: bool = False
    # The most drafts per step when the config gives no ``num_speculative_tokens``; None: the
    # drafter's checkpoint says (``Speculator.inspect_drafter``), or the config must.
    default_num_speculative_tokens: int | None = None
    prompt_lookup: bool = False  # reads ``prompt_lookup_min`` / ``prompt_lookup_max``

    def __post_init__(self) -> None:
        if self.drafting not in DRAFTING_KINDS:
            raise ValueError(f"method {self.name!r}: drafting must be one of {DRAFTING_KINDS}, got {self.drafting!r}")

    @property
    def model_optional(self) -> bool:
        """Whether ``speculative_config.model`` may be left out (a shipped drafter or the target's own layers)."""
        return bool(self.shipped_drafters) or self.model_from_target

    @property
    def free_proposal(self) -> bool:
        """Proposing costs no drafter work (a lookup in the tokens), so there is no draft cost to plan for."""
        return self.drafting == LOOKUP

    def lookahead_slots(self, k: int) -> int:
        """KV slots past the verified tokens that proposing k drafts writes (the scheduler reserves them)."""
        return {CHAIN: k, BLOCK: k + 1, LOOKUP: 0}[self.drafting]

    def draft_passes(self, ks: list[int]) -> list[int]:
        """Rows of each drafting pass when the requests of a step propose ``ks`` drafts each."""
        if self.drafting == LOOKUP:
            return []
        if self.drafting == BLOCK:
            rows = sum(k + 1 for k in ks if k > 0)
            return [rows] if rows else []
        return [sum(1 for k in ks if k >= j) for j in range(1, max(ks, default=0) + 1)]

    def speculator_class(self) -> type:
        if not isinstance(self.speculator, str):
            return self.speculator
        module, _, name = self.speculator.partition(":")
        return getattr(importlib.import_module(module), name)


METHODS: dict[str, SpeculativeMethod] = {}


def register_method(method: SpeculativeMethod) -> SpeculativeMethod:
    """Add a drafting method (its name and aliases must be new); returns it."""
    taken = [n for n in (method.name, *method.aliases) if n in METHODS]
    if taken:
        raise ValueError(f"speculative method name(s) {taken} are taken")
    for name in (method.name, *method.aliases):
        METHODS[name] = method
    return method


def method_names() -> tuple[str, ...]:
    """Every name ``speculative_config.method`` accepts, aliases included."""
    return tuple(METHODS)


def get_method(name: str) -> SpeculativeMethod:
    """The method ``speculative_config.method = name`` means (aliases resolved)."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"speculative_config.method must be one of {method_names()}, got {name!r}")
    return method


register_method(SpeculativeMethod(
    "draft_model", "tpspec.spec_decode.draft_model:DraftModelProposer", CHAIN,
))
register_method(SpeculativeMethod(
    "ngram", "tpspec.spec_decode.ngram:NgramSpeculator", LOOKUP, uses_model=False, prompt_lookup=True,
))
register_method(SpeculativeMethod(
    "dflash", "tpspec.spec_decode.dflash:DFlashSpeculator", BLOCK, defers_feed=True,
    shipped_drafters={None: "smollm2-135m-dflash", "gemma-3-270m": "gemma-3-270m-dflash"},
))
# The shipped head was trained on chains of 6 drafts (``train-draft``'s chain depth).
register_method(SpeculativeMethod(
    "eagle3", "tpspec.spec_decode.eagle:Eagle3Proposer", CHAIN, aliases=("eagle",), defers_feed=True,
    kv_reads_next_token=True,
    shipped_drafters={None: "smollm2-135m-eagle3"}, rounds_shipped_drafter_to_q4_1=True,
    default_num_speculative_tokens=6,
))
register_method(SpeculativeMethod(
    "mtp", "tpspec.spec_decode.mtp:MTPProposer", CHAIN, model_from_target=True, defers_feed=True,
    kv_reads_next_token=True,
))
