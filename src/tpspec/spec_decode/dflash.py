"""``method: dflash``: a parallel block drafter fed with the target's hidden states.

Per step, the target features of the tokens each sequence just kept are turned into context K/V
in the drafter's paged KV cache (same block tables as the target). A sequence that proposes no
drafts this step (k = 0) puts that off: its features wait in its ``DraftState``
(``DeferredContext``) and are written in one batch with the step in which it proposes again, so
steps without speculation cost the drafter nothing. Past ``max_deferred_tokens`` the oldest are
dropped unwritten (down to half as many) and the block's attention for that sequence starts after them
(``DraftState.context_start``); the draft KV is valid from there to the target's computed tokens
whenever a block is drafted. Each proposing sequence
then runs one block ``[bonus token, MASK × k]`` at positions P … P + k (the scheduler reserves
these k + 1 slots); outputs 1 … k are the k drafts, picked for all B·k rows at once by the base
class, which is where ``use_local_argmax_reduction`` pays most.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.distributed.parallel_state import get_tp_rank, single_rank
from tpspec.layers.attention import AttentionMetadata
from tpspec.models.dflash import DFlashConfig, DFlashDraftModel
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.spec_decode.speculator import (
    DraftInput,
    DrafterInfo,
    DraftModelSpeculator,
    DraftState,
    check_local_argmax_reduction,
)


@dataclass
class DeferredContext:
    """Kept tokens of one sequence whose context K/V the drafter has not written yet."""

    features: list[torch.Tensor]  # per step deferred: [n_step, len(capture_layers) · hidden_size] target features
    positions: list[int]  # [n]
    slots: list[int]  # [n] KV cache slots (the request's block table when they were kept)

    def drop_oldest(self, keep: int) -> None:
        """Keep the newest ``keep`` tokens."""
        features = torch.cat(self.features)[-keep:]  # a copy: the dropped tokens' features are freed
        self.features, self.positions, self.slots = [features], self.positions[-keep:], self.slots[-keep:]


def slots_of(positions: list[int], block_table: list[int], block_size: int) -> list[int]:
    """KV cache slot of each position of one sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class DFlashSpeculator(DraftModelSpeculator):
    def __init__(self, spec_config, engine_config, device):
        super().__init__(spec_config, engine_config, device)
        self.dflash_config = DFlashConfig.from_folder(spec_config.model)
        self.capture_layers = self.dflash_config.target_layer_ids

    @classmethod
    def inspect_drafter(cls, spec: SpeculativeConfig, target: ModelArchConfig) -> DrafterInfo:
        """One forward yields block_size − 1 drafts: what it was trained for, and the most it drafts."""
        dflash = DFlashConfig.from_folder(spec.model)
        trained = dflash.block_size - 1
        dflash.validate(target, trained if spec.num_speculative_tokens is None else spec.num_speculative_tokens)
        check_local_argmax_reduction(spec, DFlashDraftModel)
        return DrafterInfo(dflash.arch, trained)

    def _tp_context(self):
        """With draft_tensor_parallel_size=1 the draft layers are replicated (built and run as TP 1);
        the borrowed embedding and LM head stay vocab-parallel either way."""
        return single_rank() if self.replicated_draft else contextlib.nullcontext()

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        cfg = self.dflash_config
        with self._tp_context():
            with torch.device(self.device):
                model = DFlashDraftModel(cfg, target_model, target_model.dtype)
            loaded = model.load_weights(iterate_weights(self.spec_config.model, show_progress=get_tp_rank() == 0))
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"DFlash checkpoint {self.spec_config.model!r} lacks weights: {sorted(missing)[:5]}")
        model.eval()
        self.kv_caches = self._allocate_kv(model, cfg.arch.num_hidden_layers)
        return model

    def dummy_feed(self, num_rows: int) -> None:
        width = len(self.capture_layers) * self.engine_config.arch.hidden_size
        features = torch.zeros(num_rows, width, dtype=self.model.dtype, device=self.device)
        slots = torch.arange(num_rows, device=self.device) % self.num_kv_slots
        positions = torch.arange(num_rows, device=self.device) % self.engine_config.scheduler.max_model_len
        with self._tp_context():
            self.model.write_context(features, positions, slots, self.kv_caches)

    def dummy_pass(self, num_rows: int) -> None:
        md, positions = self.dummy_metadata(num_rows, self.num_speculative_tokens + 1, non_causal=True)
        embeds = self.model.target.embed_input_ids(torch.zeros(num_rows, dtype=torch.int64, device=self.device))
        with self._tp_context():
            hidden = self.model(embeds, positions, self.kv_caches, md)
        self.dummy_sample(hidden)

    def _feed_deferred(self, state: DraftState, block_table: list[int]) -> int:
        deferred, state.deferred = state.deferred, None
        self._write_context(deferred.features, deferred.positions, deferred.slots)
        return len(deferred.positions)

    def _write_context(self, features: list[torch.Tensor], positions: list[int], slots: list[int]) -> None:
        """Context K/V of kept tokens: ``features`` chunks [n_i, width] concatenated, one row per
        entry of ``positions`` and ``slots`` (their KV cache slots)."""
        with self._tp_context():
            self.model.write_context(
                torch.cat(features),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                torch.tensor(slots, dtype=torch.int64, device=self.device),
                self.kv_caches,
            )

    @torch.inference_mode()
    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        bs = self.engine_config.cache.block_size
        # 1. Context K/V of every kept token of the proposing sequences (with what they deferred);
        # the others defer theirs.
        ctx_features, ctx_pos, ctx_slots = [], [], []
        offset = 0
        for i in range(len(inp.token_ids)):
            n = inp.num_context(i)
            features = inp.target_features[offset : offset + n]  # [n, width]
            offset += n
            pos = list(range(inp.start_pos[i], inp.start_pos[i] + n))
            slots = slots_of(pos, inp.block_tables[i], bs)
            backlog, states[i].deferred = states[i].deferred, None
            chunks = [features]
            if backlog is not None:  # extended in place: a step adds its rows, nothing is copied again
                backlog.positions += pos
                backlog.slots += slots
                chunks, pos, slots = backlog.features + chunks, backlog.positions, backlog.slots
            if inp.num_drafts[i] == 0 and (len(pos) <= self.max_deferred_tokens or inp.sampled[i]):  # a prefill chunk past it is written
                deferred = DeferredContext(chunks, pos, slots)
                if len(pos) > self.max_deferred_tokens:  # the oldest dropped: the drafter's context starts after them
                    deferred.drop_oldest(self.kept_after_drop)
                    states[i].context_start = deferred.positions[0]
                else:
                    chunks[-1] = features.clone()  # a view would keep the step's captured hidden states alive
                states[i].deferred = deferred if pos else None
                continue
            ctx_features += chunks
            ctx_pos += pos
            ctx_slots += slots
        if ctx_pos:
            self._write_context(ctx_features, ctx_pos, ctx_slots)
        # 2. One block per proposing sequence: [bonus, MASK × (L − 1)] at positions P … P + L − 1,
        # L = k + 1 for its k = num_drafts[i], unless max_model_len cuts it (a draft there could
        # never be verified). Blocks of different lengths share one forward.
        max_len = self.engine_config.scheduler.max_model_len
        rows, starts, lens = [], [], []
        for i in inp.proposing:
            start = inp.start_pos[i] + inp.num_context(i)
            length = min(inp.num_drafts[i] + 1, max_len - start)
            if length >= 2:
                rows.append(i)
                starts.append(start)
                lens.append(length)
        if not rows:
            return len(ctx_pos)
        mask = self.dflash_config.mask_token_id
        block_ids = [t for i, n in zip(rows, lens) for t in [inp.token_ids[i][-1]] + [mask] * (n - 1)]
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        tables = [inp.block_tables[i] for i in rows]
        md = AttentionMetadata.build(lens, [s + n for s, n in zip(starts, lens)], tables, bs, self.device, non_causal_tail=lens,
                                     first_keys=[states[i].context_start for i in rows])
        embeds = self.model.target.embed_input_ids(torch.tensor(block_ids, dtype=torch.int64, device=self.device))
        with self._tp_context():
            hidden = self.model(embeds, torch.tensor(positions, dtype=torch.int64, device=self.device), self.kv_caches, md)
        # 3. Outputs 1 … L − 1 of each block are its drafts: all rows sampled at once.
        offsets = torch.cumsum(torch.tensor([0] + lens[:-1]), 0).tolist()
        draft_rows = [o + j for o, n in zip(offsets, lens) for j in range(1, n)]
        sampling = None
        if inp.sampling is not None:
            which = [r for r, n in enumerate(lens) for _ in range(n - 1)]  # proposing row of each draft row
            proposing = {i: r for r, i in enumerate(inp.proposing)}
            device = inp.sampling.seeds.device
            sampling = inp.sampling.select(torch.tensor([proposing[rows[r]] for r in which], device=device),
                                           torch.tensor([s + j for s, n in zip(starts, lens) for j in range(1, n)],
                                                        device=device))
        grammars = self.grammars_of(inp, rows)
        if grammars is not None and any(g is not None for g in grammars):
            self._sample_under_grammars(hidden, draft_rows, sampling, lens, grammars, [states[i] for i in rows])
            return len(ctx_pos)
        sample = self.sample_draft(hidden[torch.tensor(draft_rows, device=self.device)], sampling)
        tokens = sample.token_ids.tolist()
        o = 0
        for i, n in zip(rows, lens):
            states[i].draft_ids = tokens[o : o + n - 1]
            if sample.dists is not None:
                states[i].draft_dists = sample.dists[o : o + n - 1]  # [n − 1, vocab_size]
            o += n - 1
        return len(ctx_pos)

    def _sample_under_grammars(
        self, hidden: torch.Tensor, draft_rows: list[int], sampling, lens: list[int], grammars: list,
        states: list[DraftState],
    ) -> None:
        """Structured outputs: a block's drafts come out of one forward, but draft j's mask depends
        on drafts 1 … j − 1, so they are drawn position by position (one sampling pass per draft
        position instead of one for all), each under the mask after the drafts before it."""
        starts = torch.cumsum(torch.tensor([0] + [n - 1 for n in lens[:-1]]), 0).tolist()  # row r's draft 1 in draft_rows
        tokens: list[list[int]] = [[] for _ in lens]
        dists: list[list[torch.Tensor]] = [[] for _ in lens]
        going = [n > 1 for n in lens]
        for j in range(max(lens) - 1):
            active = [r for r, n in enumerate(lens) if going[r] and j < n - 1]
            if not active:
                break
            at = [starts[r] + j for r in active]  # indices into draft_rows (and sampling's rows)
            meta = None if sampling is None else sampling.select(torch.tensor(at, device=sampling.seeds.device))
            sample = self.sample_draft(hidden[torch.tensor([draft_rows[a] for a in at], device=self.device)], meta,
                                       self.draft_bitmask(grammars, active))
            for a, (r, token) in enumerate(zip(active, sample.token_ids.tolist())):
                tokens[r].append(token)
                if sample.dists is not None:
                    dists[r].append(sample.dists[a])
                if grammars[r] is not None and not grammars[r].draft(token):
                    going[r] = False  # refused (the grammar is complete): no further drafts
        for state, t, d in zip(states, tokens, dists):
            state.draft_ids, state.draft_dists = t, (torch.stack(d) if d else None)

