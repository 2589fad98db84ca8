"""``method: draft_model``: an independent smaller model with the target's vocabulary, run
autoregressively for k steps with its own paged KV cache (same block tables as the target)."""

from __future__ import annotations

import contextlib
import torch

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.distributed.parallel_state import get_tp_rank, single_rank
from tpspec.layers.attention import AttentionMetadata
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.registry import get_model_class
from tpspec.spec_decode.speculator import (
    DraftInput,
    DrafterInfo,
    DraftModelSpeculator,
    DraftState,
    check_local_argmax_reduction,
)


class DraftModelProposer(DraftModelSpeculator):
    @classmethod
    def inspect_drafter(cls, spec: SpeculativeConfig, target: ModelArchConfig) -> DrafterInfo:
        arch = ModelArchConfig.from_folder(spec.model)
        check_local_argmax_reduction(spec, get_model_class(arch.architecture))
        return DrafterInfo(arch)

    @property
    def replicated_lm_head(self) -> bool:
        """A replicated draft model is replicated whole, its LM head included."""
        return self.replicated_draft

    def _tp_context(self):
        """A replicated draft is built and run as TP 1."""
        return single_rank() if self.replicated_lm_head else contextlib.nullcontext()

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        folder = self.spec_config.model
        arch = ModelArchConfig.from_folder(folder)
        with self._tp_context():
            with torch.device(self.device):
                model = get_model_class(arch.architecture)(arch, target_model.dtype)
            model.load_weights(iterate_weights(folder, show_progress=get_tp_rank() == 0))
        model.eval()
        self.kv_caches = self._allocate_kv(model, arch.num_hidden_layers)
        return model

    def _forward(self, token_ids: list[list[int]], start_pos: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Feed each sequence's tokens; returns the hidden state of each sequence's last token [seqs, H]."""
        lens = [len(t) for t in token_ids]
        md = AttentionMetadata.build(
            lens, [s + n for s, n in zip(start_pos, lens)], tables, self.engine_config.cache.block_size, self.device
        )
        ids = torch.tensor([t for ts in token_ids for t in ts], dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_pos, lens)]).to(self.device)
        hidden, _ = self.model(ids, pos, self.kv_caches, md)
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        return hidden[ends.to(self.device)]

    def _dummy_forward(self, num_rows: int, query_len: int) -> torch.Tensor:
        md, positions = self.dummy_metadata(num_rows, query_len)
        ids = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        with self._tp_context():
            hidden, _ = self.model(ids, positions, self.kv_caches, md)
        return hidden

    def dummy_feed(self, num_rows: int) -> None:
        self._dummy_forward(num_rows, self.num_speculative_tokens + 1)

    def dummy_pass(self, num_rows: int) -> None:
        hidden = self._dummy_forward(num_rows, 1)
        with self._tp_context():
            self.dummy_sample(hidden)

    @torch.inference_mode()
    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        rows = inp.proposing
        fed = sum(len(t) for t in inp.token_ids)
        with self._tp_context():
            last_hidden = self._forward(inp.token_ids, inp.start_pos, inp.block_tables)
            if not rows:
                return fed
            hidden = last_hidden[torch.tensor(rows, device=self.device)]
            pos, tables, num = self.chain_rows(inp, rows)  # position of draft 1, block table, drafts per row
            if not any(num):
                return fed

            def advance(active: list[int], keep: list[int], tokens: list[int], j: int) -> torch.Tensor:
                return self._forward([[t] for t in tokens], [pos[r] + j for r in active], [tables[r] for r in active])

            chain, chain_dists = self.draft_chain(hidden, num, pos, inp.sampling, advance, self.grammars_of(inp, rows))
        for r, i in enumerate(rows):
            states[i].draft_ids, states[i].draft_dists = chain[r], chain_dists[r]
        return fed
