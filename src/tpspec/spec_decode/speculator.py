"""``Speculator``, the rank-side object of a drafting method, and ``DraftModelSpeculator``, the
base class of every model-based drafter.

A speculator owns what it keeps per request between steps (``DraftState``: the drafts proposed
for the next step, their draft distributions, the feed it put off), from ``add`` to ``forget``;
the model runner hands it each step's verified tokens (``DraftInput``) and reads the drafts back.

``DraftModelSpeculator`` owns the one place where draft tokens are picked. Greedy drafting with
``use_local_argmax_reduction`` asks the draft model for ``get_top_tokens`` (each rank reduces
its vocab shard; only (value, id) pairs cross the wire, O(2·tp) per row); without the flag it
all-gathers the full logits and takes the argmax (O(vocab) per row). Probabilistic drafting
samples from the draft distribution q and keeps it for lossless verification: with the flag by
a sharded Gumbel-max, keeping only this rank's columns of q (O(3·tp) per row, models with
``compute_logits_shard``), else from the gathered logits. Subclasses
run their model and call ``sample_draft``; they never sample by themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpspec.config import GGUF_KERNEL_METHODS, EngineConfig, ModelArchConfig, SpeculativeConfig
from tpspec.distributed import comm
from tpspec.layers.argmax import argmax_rows
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache, kv_cache_dtype
from tpspec.layers.cpu_weights import pack_cpu_weights
from tpspec.sample import token_bitmask
from tpspec.sample.sampler import SamplingMetadata
from tpspec.spec_decode.draft_sampling import sample_draft_full, sample_draft_shard
from tpspec.spec_decode.drafter_rounding import round_drafter_to_q4_1
from tpspec.spec_decode.resolve import is_shipped_drafter
from tpspec.spec_decode.step_profile import profile_context
from tpspec.structured.request_grammar import RequestGrammar

DRAFT_SAMPLE_SITE = "draft.sample"
# A capture id past the layers: the target's final-norm output, the hidden state its LM head reads
# (what an MTP module takes; vLLM feeds MTP the target model's output, which is after the final norm).
FINAL_HIDDEN = -1


def target_features(layers: tuple[int, ...], captured: dict[int, torch.Tensor], final: torch.Tensor) -> torch.Tensor:
    """The features a drafter reads, [num_tokens, len(layers)·H]: per capture id in ``layers`` the
    captured output of that layer (``captured[L]``, [num_tokens, H]) or, for ``FINAL_HIDDEN``, the
    target's final-norm output ``final`` [num_tokens, H], concatenated in ``layers`` order."""
    return torch.cat([final if layer == FINAL_HIDDEN else captured[layer] for layer in layers], dim=-1)


@dataclass
class DraftSample:
    token_ids: torch.Tensor  # [rows] int64
    # Probabilistic drafting only: the draft distribution q each token was drawn from, full or,
    # with use_local_argmax_reduction, this rank's columns (spec_decode.draft_sampling).
    dists: torch.Tensor | None = None  # [rows, vocab_size] or [rows, shard_size] float32


@dataclass
class DraftInput:
    """Per scheduled sequence, after verification: the tokens the drafter (re)feeds.

    ``token_ids[i]`` are this step's real tokens of sequence i plus its accepted drafts and the
    new bonus/recovered token, starting at position ``start_pos[i]``; the drafter's KV below
    ``start_pos[i]`` is valid. ``sampled[i]`` is False for a partial prefill chunk (no new token).
    ``num_drafts[i]`` drafts are wanted for sequence i's next step: 0 feeds the drafter only (its
    state stays valid for later steps), whatever k was before or will be after.

    ``target_features`` (drafters with ``capture_layers``): the target's hidden states at those
    layers, concatenated, for each token the target has run and kept, sequence by sequence:
    ``token_ids[i][:-1]`` for a sampled sequence (its last token is the new bonus/recovered
    token, which the target has not run yet), all of ``token_ids[i]`` otherwise.

    ``all_token_ids(i)``: every token of sequence i's request so far (a lookup drafter reads them).

    ``grammars[i]``: sequence i's grammar (structured outputs), at its committed output; None when
    no sequence has one. Drafters that pick tokens draw each draft under its position's mask
    (``DraftModelSpeculator.sample_draft``); ``Speculator.propose`` then holds every sequence's
    drafts up to the first the grammar forbids (``RequestGrammar.settle``).
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    start_pos: list[int]
    block_tables: list[list[int]]
    sampled: list[bool]
    num_drafts: list[int]
    sampling: SamplingMetadata | None  # one row per sequence with num_drafts > 0 (probabilistic drafting)
    target_features: torch.Tensor | None = None  # [num_context_tokens, len(capture_layers)·hidden_size]
    all_token_ids: Callable[[int], list[int]] | None = None
    grammars: list[RequestGrammar | None] | None = None

    def num_context(self, i: int) -> int:
        """How many of sequence i's tokens have target features."""
        return len(self.token_ids[i]) - int(self.sampled[i])

    @property
    def proposing(self) -> list[int]:
        """Sequences that want drafts."""
        return [i for i, n in enumerate(self.num_drafts) if n > 0]


@dataclass
class DraftState:
    """What a speculator keeps for one request between steps."""

    draft_ids: list[int] = field(default_factory=list)  # proposed for the request's next step
    draft_dists: torch.Tensor | None = None  # [len(draft_ids), width] q of probabilistic drafts (see DraftSample)
    # The drafter's work on the request's latest kept tokens put off until it next proposes (its
    # own type, with the ``positions`` it covers: ``dflash.DeferredContext``,
    # ``chain_head.DeferredRows``); None: none.
    deferred: object | None = None
    # The first position the drafter's attention reads for this request: its KV is written from
    # there on (below: cached blocks without it, or deferred work it dropped).
    context_start: int = 0


@dataclass(frozen=True)
class DrafterInfo:
    """What a speculator class reads from its draft checkpoint before any worker starts."""

    arch: ModelArchConfig | None  # the draft's shape (None: no model)
    num_speculative_tokens: int | None = None  # the drafts per step it was trained for, if it says


class Speculator:
    """The rank-side object of a drafting method (one row of ``config.speculative_methods``).

    Subclasses implement ``_propose``; model-based ones derive from ``DraftModelSpeculator``."""

    # Target layer ids whose outputs (Hugging Face ``hidden_states[L + 1]``) the drafter reads, or
    # FINAL_HIDDEN for the target's final-norm output.
    capture_layers: tuple[int, ...] = ()
    # Whether a probabilistic draft's q is kept as this rank's vocab columns rather than full width.
    dists_sharded: bool = False
    model = None  # the draft model, if any

    def __init__(self, spec_config: SpeculativeConfig, engine_config: EngineConfig, device: torch.device):
        self.spec_config = spec_config
        self.engine_config = engine_config
        self.device = device
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.draft_sample_method = spec_config.draft_sample_method
        self.states: dict[str, DraftState] = {}

    @classmethod
    def inspect_drafter(cls, spec: SpeculativeConfig, target: ModelArchConfig) -> DrafterInfo:
        """Check the drafter (``spec.model``, resolved) and the flags against the target, in the
        engine's process before any worker starts; raise ``ValueError`` on a mismatch."""
        return DrafterInfo(None)

    def load(self, target_model: torch.nn.Module, num_kv_slots: int) -> None:
        """Build whatever the method runs on this rank (its KV cache gets ``num_kv_slots`` slots,
        the target's count, so the target's block tables address it)."""

    # ---- per-request state ------------------------------------------------------------------
    def add(self, req_id: str) -> None:
        self.states[req_id] = DraftState()

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def restart(self, req_id: str, context_start: int) -> None:
        """The request's KV starts (again, after a preemption) from its cached blocks, whose drafter
        KV is written from ``context_start`` on: work put off on its old slots is void, they may
        belong to another request by now."""
        state = self.states[req_id]
        state.deferred, state.context_start = None, context_start

    def drafts(self, req_id: str) -> list[int]:
        """The drafts held for the request's next step."""
        return self.states[req_id].draft_ids

    def draft_dists(self, req_id: str) -> torch.Tensor | None:
        """q of the held drafts ([len(drafts), width]; probabilistic drafting), or None."""
        return self.states[req_id].draft_dists

    def lag(self, req_id: str) -> int:
        """How many of the request's latest computed tokens the drafter has not fed yet (its
        deferred feed): its KV at those positions is not written."""
        deferred = self.states[req_id].deferred
        return 0 if deferred is None else len(deferred.positions)

    def context_start(self, req_id: str) -> int:
        """The first position whose drafter KV the request's drafting reads (``DraftState``)."""
        return self.states[req_id].context_start

    def settle(self, req_id: str, block_table: list[int]) -> int:
        """An ended request's deferred feed, so that its blocks can be cached: fed if it is at most
        ``max_flushed_tokens`` rows or k + 1 (what a drafting request leaves), else given up (a request
        held at k = 0: its blocks are cached without drafter KV, rather than every held request
        paying its feed at its end; its drafter context then starts past them). Returns the rows fed."""
        return 0

    # ---- proposing --------------------------------------------------------------------------
    def propose(self, inp: DraftInput) -> int:
        """Feed this step's kept tokens and hold ``inp.num_drafts[i]`` drafts (at most) for each
        sequence's next step. Returns the rows the drafter fed (context K/V written, refed, or run
        through a draft model), deferred rows it caught up on included: what its time was spent
        on (``StepTimeModel.observe``)."""
        states = [self.states[r] for r in inp.req_ids]
        for state in states:
            state.draft_ids, state.draft_dists = [], None
        fed = self._propose(inp, states)
        for state, grammar, sampled in zip(states, inp.grammars or (), inp.sampled):
            if grammar is not None and sampled:
                held = grammar.settle(state.draft_ids)
                if held < len(state.draft_ids):
                    state.draft_ids = state.draft_ids[:held]
                    state.draft_dists = None if state.draft_dists is None else state.draft_dists[:held]
        return fed

    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        """``propose`` for the sequences of ``inp``, whose states are ``states`` (drafts cleared)."""
        raise NotImplementedError

    # ---- profiling (engine.speculation.step_time) ------------------------------------------------
    def dummy_feed(self, num_rows: int) -> None:
        """The drafter's work for ``num_rows`` kept tokens that does not depend on k, on dummy
        inputs in the first KV blocks (start-up, before any request owns one)."""

    def dummy_pass(self, num_rows: int) -> None:
        """One drafting pass over ``num_rows`` rows (forward, LM head, draft sampling), on dummy inputs."""


def check_local_argmax_reduction(spec: SpeculativeConfig, model_class: type) -> None:
    """``use_local_argmax_reduction`` against the draft model class (vLLM's check at model load):
    greedy drafting needs ``get_top_tokens``; probabilistic drafting a ``compute_logits_shard``."""
    if not spec.use_local_argmax_reduction:
        return
    if spec.draft_sample_method == "probabilistic":
        # Sharded Gumbel-max needs the model's local logits shard; without it, the full q.
        if not callable(getattr(model_class, "compute_logits_shard", None)):
            raise ValueError(
                "speculative_config.use_local_argmax_reduction=true only applies to greedy draft selection; "
                "draft_sample_method='probabilistic' needs the full draft distribution "
                f"({model_class.__name__} has no compute_logits_shard() for vocab-parallel drafting)"
            )
        return
    if not callable(getattr(model_class, "get_top_tokens", None)):
        raise ValueError(
            f"speculative_config.use_local_argmax_reduction=true needs a draft model with get_top_tokens(); "
            f"{model_class.__name__} has none"
        )


class DraftModelSpeculator(Speculator):
    # Kept tokens a drafter that defers its feed (DFlash, the chain heads) lets one sequence that
    # proposes nothing leave unfed (their target features wait on the rank, 4 · capture layers ·
    # hidden size bytes each); past this the oldest are dropped, unfed, down to half as many (so
    # that the copy a drop makes comes once per that many steps), and the request's drafter
    # context starts after them (``DraftState.context_start``): a request held at k = 0 costs
    # the drafter nothing, and one that proposes again feeds at most this many rows first.
    max_deferred_tokens: int = 64
    # The most deferred rows an ended request's drafter still feeds (``settle``), at least what a
    # drafting request leaves (its last step's: k + 1), so that its cached blocks keep their
    # drafter KV (with k pinned, a cache hit then gives the same drafts as none).
    max_flushed_tokens: int = 16
    # True when the draft tokens come from a whole (unsharded) LM head on every rank.
    replicated_lm_head: bool = False

    @property
    def kept_after_drop(self) -> int:
        """The deferred tokens a drop keeps (the newest)."""
        return max(1, self.max_deferred_tokens // 2)

    def settle(self, req_id: str, block_table: list[int]) -> int:
        state = self.states[req_id]
        if state.deferred is None:
            return 0
        if len(state.deferred.positions) > max(self.max_flushed_tokens, self.num_speculative_tokens + 1):
            state.context_start, state.deferred = state.deferred.positions[-1] + 1, None
            return 0
        return self._feed_deferred(state, block_table)

    def _feed_deferred(self, state: DraftState, block_table: list[int]) -> int:
        """Feed the request's whole deferred backlog now (``settle``); returns the rows fed."""
        raise NotImplementedError

    @property
    def replicated_draft(self) -> bool:
        """``draft_tensor_parallel_size`` 1 under TP > 1: the drafter's own layers are whole on
        every rank (built and run as TP 1)."""
        return self.spec_config.draft_tensor_parallel_size == 1 and self.engine_config.parallel.tensor_parallel_size > 1

    @property
    def dists_sharded(self) -> bool:
        """Whether a probabilistic draft's q is kept as this rank's vocab columns (the flag with a
        vocab-parallel LM head) rather than full width."""
        return self.use_local_argmax_reduction and not self.replicated_lm_head

    def __init__(self, spec_config: SpeculativeConfig, engine_config: EngineConfig, device: torch.device):
        super().__init__(spec_config, engine_config, device)
        self.use_local_argmax_reduction = spec_config.use_local_argmax_reduction

    # ---- loading --------------------------------------------------------------------------
    def load(self, target_model: torch.nn.Module, num_kv_slots: int) -> None:
        """Build the draft model; under ``--quantization q4_1``, ``w4a16`` or ``w4a8`` a shipped
        drafter's own weights are rounded to Q4_1 where its method says so, then its weights are
        packed for the CPU."""
        self.num_kv_slots = num_kv_slots
        self.model = self._build_model(target_model)
        quantization = self.engine_config.quantization
        if (quantization in GGUF_KERNEL_METHODS and self.spec_config.method_spec.rounds_shipped_drafter_to_q4_1
                and is_shipped_drafter(self.spec_config.model)):
            round_drafter_to_q4_1(self.model, target_model)
        pack_cpu_weights(self.model, quantization)

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def _allocate_kv(self, model: torch.nn.Module, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The drafter's paged KV cache, ``num_kv_slots`` slots (the target's block tables address it)."""
        dtype = kv_cache_dtype(self.engine_config.cache.kv_cache_dtype, model.dtype, self.device)
        return allocate_kv_cache(num_layers, self.num_kv_slots, model.kv_cache_shape, dtype, self.device)

    # ---- draft selection --------------------------------------------------------------------
    def _greedy_sample_draft(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [rows, hidden_size] -> [rows] int64 draft ids (under ``bitmask`` [rows, words], if given)."""
        if self.use_local_argmax_reduction:
            return self.model.get_top_tokens(hidden, site=DRAFT_SAMPLE_SITE, bitmask=bitmask)
        logits = self.model.compute_logits(hidden, site=DRAFT_SAMPLE_SITE)
        token_bitmask.apply(logits, bitmask, argmax_only=True)
        return argmax_rows(logits)

    def sample_draft(
        self, hidden: torch.Tensor, sampling: SamplingMetadata | None, bitmask: torch.Tensor | None = None
    ) -> DraftSample:
        """hidden: [rows, hidden_size]; ``sampling``: one row per hidden row (positions = the
        position each draft token will take); ``bitmask``: the rows' grammar masks [rows, words]
        (structured outputs; applied to the draft logits, each rank to its own columns with the
        flag). Greedy requests draft greedily either way. Probabilistic drafting keeps q: full
        ``[rows, vocab_size]``, or with ``use_local_argmax_reduction`` this rank's columns
        ``[rows, shard_size]`` (never gathered)."""
        comm.count_rows(DRAFT_SAMPLE_SITE, hidden.shape[0])
        if self.draft_sample_method == "greedy":
            return DraftSample(self._greedy_sample_draft(hidden, bitmask))
        if self.use_local_argmax_reduction:
            shard = self.model.compute_logits_shard(hidden)  # [rows, shard_size], no communication
            token_bitmask.apply(shard, bitmask)
            return DraftSample(*sample_draft_shard(shard, sampling, DRAFT_SAMPLE_SITE))
        logits = self.model.compute_logits(hidden, site=DRAFT_SAMPLE_SITE)
        token_bitmask.apply(logits, bitmask)
        return DraftSample(*sample_draft_full(logits, sampling))

    def draft_bitmask(self, grammars: list[RequestGrammar | None] | None, rows: list[int]) -> torch.Tensor | None:
        """The next draft position's masks of ``rows`` (indices into ``grammars``): ``[len(rows),
        words]`` int32, all ones for a row without a grammar; None when none of them has one."""
        if grammars is None or all(grammars[r] is None for r in rows):
            return None
        width = next(grammars[r].words for r in rows if grammars[r] is not None)
        every = torch.full((width,), -1, dtype=torch.int32)
        return torch.stack([every if grammars[r] is None else grammars[r].draft_mask() for r in rows]).to(self.device)

    @staticmethod
    def grammars_of(inp: DraftInput, rows: list[int]) -> list[RequestGrammar | None] | None:
        """The grammars of sequences ``rows`` (None: no sequence of the step has one)."""
        return None if inp.grammars is None else [inp.grammars[i] for i in rows]

    def chain_rows(self, inp: DraftInput, rows: list[int]) -> tuple[list[int], list[list[int]], list[int]]:
        """For proposing sequences ``rows``: the position of each one's draft 1, its block table, and
        how many drafts it gets. A draft at a position >= max_model_len can never be verified:
        feeding stops before it, so the drafter writes no KV there (the scheduler reserves none)
        and never indexes past the RoPE tables."""
        pos = [inp.start_pos[i] + len(inp.token_ids[i]) for i in rows]
        max_len = self.engine_config.scheduler.max_model_len
        num = [max(0, min(inp.num_drafts[i], max_len - p)) for i, p in zip(rows, pos)]
        return pos, [inp.block_tables[i] for i in rows], num

    def draft_chain(
        self, hidden: torch.Tensor, num: list[int], positions: list[int], sampling: SamplingMetadata | None,
        advance: Callable[[list[int], list[int], list[int], int], torch.Tensor],
        grammars: list[RequestGrammar | None] | None = None,
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Chain drafting: row r wants ``num[r]`` drafts, the first from ``hidden[r]`` ([rows, H]) at
        ``positions[r]`` (``sampling``: one row per r). Each pass samples only the rows still
        drafting; after pass j (0-based), ``advance(rows, keep, tokens, j)`` feeds ``tokens``
        (draft j + 1 of each row still drafting) and returns the next hidden states of ``rows``,
        where ``keep`` are those rows' indices into the current ``hidden``. ``grammars``: per row
        its grammar or None (each pass draws under the masks after the drafts so far; a row whose
        draft the grammar refuses stops drafting). Returns per row its drafts and (probabilistic
        drafting) their q ``[num[r], width]``."""
        num = list(num)
        drafts: list[list[int]] = [[] for _ in num]
        dists: list[list[torch.Tensor]] = [[] for _ in num]
        active = [r for r, n in enumerate(num) if n > 0]
        if len(active) < len(num):
            hidden = hidden[torch.tensor(active, dtype=torch.int64, device=hidden.device)]
        j = 0
        while active:
            meta = None
            if sampling is not None:
                meta = sampling.select(torch.tensor(active, device=sampling.seeds.device),
                                       torch.tensor([positions[r] + j for r in active], device=sampling.seeds.device))
            sample = self.sample_draft(hidden, meta, self.draft_bitmask(grammars, active))
            ids = sample.token_ids.tolist()
            for a, r in enumerate(active):
                drafts[r].append(ids[a])
                if sample.dists is not None:
                    dists[r].append(sample.dists[a])
                if grammars is not None and grammars[r] is not None and not grammars[r].draft(ids[a]):
                    num[r] = j + 1  # refused (the grammar is complete): no further drafts
            keep = [a for a, r in enumerate(active) if num[r] > j + 1]
            if not keep:
                break
            active = [active[a] for a in keep]
            hidden = advance(active, keep, [ids[a] for a in keep], j)
            j += 1
        return drafts, [torch.stack(d) if d else None for d in dists]

    # ---- profiling helpers ------------------------------------------------------------------
    def dummy_metadata(self, num_rows: int, query_len: int, non_causal: bool = False):
        """``AttentionMetadata.dummy`` for the drafter's profile: sequences of ``query_len`` rows
        after ``step_profile.profile_context`` earlier tokens. Returns (metadata, positions [num_rows])."""
        context = profile_context(self.engine_config.scheduler.max_model_len, self.num_kv_slots, query_len)
        return AttentionMetadata.dummy(
            num_rows, query_len, self.engine_config.cache.block_size, self.device, non_causal, context=context
        )

    def dummy_sample(self, hidden: torch.Tensor) -> None:
        """Draft sampling as ``sample_draft`` does it, for every row of ``hidden`` [rows, H]."""
        sampling = None
        if self.draft_sample_method == "probabilistic":
            from tpspec.sampling_params import SamplingParams

            rows = hidden.shape[0]
            sampling = SamplingMetadata.from_params(
                [SamplingParams(temperature=1.0)] * rows, [0] * rows, [0] * rows, device=self.device
            )
        self.sample_draft(hidden, sampling)
