"""``method: eagle3`` (alias ``eagle``): an EAGLE-3 head drafting a chain of k tokens from the
target's hidden states, with its own one-layer paged KV cache addressed by the target's block
tables (draft KV valid below the target's computed tokens, rewritten by refeeding).

Row t of the head pairs the fused target features at position t with the embedding of token
t + 1 and sits at position t; its output predicts token t + 2. So each step first refeeds, per
sequence, every kept position whose next token is known: for a proposing sequence with tokens
``x_s … x_n`` (x_n the new bonus/recovered token) rows s … n − 1, the last of which yields draft
1 (position n + 1). Draft j + 1 then comes from a row at position n + j − 1 that feeds draft j
with the previous row's pre-norm output in place of target features. The k − 1 chained rows sit
at positions n … n + k − 2, inside the k lookahead slots the scheduler reserves.

A partial prefill chunk ``x_s … x_e`` feeds rows s … e − 1 only: its last row needs x_{e+1},
which the next chunk brings, and the target features of x_e are gone by then, so the draft KV
of position e stays unwritten (a stale key for that sequence's later drafts; outputs are still
verified by the target, so this costs acceptance, never correctness).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from safetensors import safe_open

from tpspec.distributed.parallel_state import get_tp_rank
from tpspec.layers.attention import AttentionMetadata
from tpspec.models.eagle3 import Eagle3Config, Eagle3LlamaForCausalLM
from tpspec.models.loader.safetensors import checkpoint_files, iterate_weights
from tpspec.spec_decode.speculator import DraftInput, DraftModelSpeculator, DraftOutput


def ships_embedding(folder: str) -> bool:
    """Whether the EAGLE-3 checkpoint in ``folder`` has its own ``embed_tokens.weight``."""
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt") as f:
            if "embed_tokens.weight" in f.keys():
                return True
    return False


class Eagle3Proposer(DraftModelSpeculator):
    def __init__(self, spec_config, engine_config, device):
        super().__init__(spec_config, engine_config, device)
        self.eagle_config = Eagle3Config.from_folder(spec_config.model)
        self.ships_embedding = ships_embedding(spec_config.model)
        self.eagle_config.validate(engine_config.arch, self.ships_embedding)
        # fc's inputs in fc order (a layer may repeat); the runner concatenates them in this order.
        self.capture_layers = self.eagle_config.fc_layers(engine_config.arch.num_hidden_layers)

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        """The midlayer follows draft_tensor_parallel_size (1: replicated, else split like the
        target); the embedding and the draft LM head are vocab-parallel either way."""
        folder = self.spec_config.model
        tp = self.engine_config.parallel.tensor_parallel_size
        replicated = self.spec_config.draft_tensor_parallel_size == 1 and tp > 1
        target_embed = None if self.ships_embedding else target_model.embed_tokens
        with torch.device(self.device):
            model = Eagle3LlamaForCausalLM(self.eagle_config, target_model.config, target_embed, target_model.dtype, replicated)
        model.load_weights(iterate_weights(folder, show_progress=get_tp_rank() == 0))
        model.eval()
        (self.kv_cache,) = self._allocate_kv(model, 1)  # one midlayer
        return model

    def _run(
        self, ids: list[int], positions: list[int], hidden: torch.Tensor, query_lens: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over the rows of several sequences (``query_lens[i]`` consecutive rows
        each, the last at the sequence's newest position); returns (normed, prenorm) [rows, H]."""
        ends = torch.cumsum(torch.tensor(query_lens), 0) - 1
        context_lens = [positions[e] + 1 for e in ends.tolist()]
        md = AttentionMetadata.build(query_lens, context_lens, tables, self.engine_config.cache.block_size, self.device)
        return self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            hidden,
            self.kv_cache,
            md,
        )

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> DraftOutput:
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in inp.token_ids]
        dists: list[torch.Tensor | None] = [None for _ in inp.token_ids]
        # 1. Refeed: row t = (features at t, token t + 1) at position t, for every kept t whose next token is known.
        ids, positions, feature_rows, fed, lens = [], [], [], [], []
        offset = 0
        for i, tokens in enumerate(inp.token_ids):
            n = len(tokens) - 1  # rows with a known next token
            if n > 0:
                ids += tokens[1:]
                positions += range(inp.start_pos[i], inp.start_pos[i] + n)
                feature_rows += range(offset, offset + n)
                fed.append(i)
                lens.append(n)
            offset += inp.num_context(i)
        if not fed:
            return DraftOutput(drafts, dists)
        features = inp.target_features[torch.tensor(feature_rows, dtype=torch.int64, device=self.device)]  # [rows, n·H_t]
        hidden = self.model.combine_hidden_states(features)  # [rows, H]
        normed, prenorm = self._run(ids, positions, hidden, lens, [inp.block_tables[i] for i in fed])
        rows = [i for i, p in enumerate(inp.propose) if p]  # every proposing sequence has >= 2 tokens: fed
        if not rows:
            return DraftOutput(drafts, dists)
        ends = (torch.cumsum(torch.tensor(lens), 0) - 1).tolist()
        end_of = dict(zip(fed, ends))
        last = torch.tensor([end_of[i] for i in rows], device=self.device)
        normed, prenorm = normed[last], prenorm[last]  # [len(rows), H]
        # 2. Chain: draft j + 1 from a row at position n + j - 1 feeding draft j (n: the bonus token's position).
        pos = [inp.start_pos[i] + len(inp.token_ids[i]) for i in rows]  # position of draft 1
        tables = [inp.block_tables[i] for i in rows]
        # A draft at a position >= max_model_len can never be verified: feeding stops before it.
        max_len = self.engine_config.scheduler.max_model_len
        num = [max(0, min(k, max_len - p)) for p in pos]  # usable drafts per row
        step_tokens, step_dists = [], []
        for j in range(k):
            sampling = None
            if inp.sampling is not None:
                draft_pos = torch.tensor([p + j for p in pos], dtype=torch.int64, device=self.device)
                sampling = replace(inp.sampling, positions=draft_pos)
            sample = self.sample_draft(normed, sampling)
            step_tokens.append(sample.token_ids)
            step_dists.append(sample.dists)
            feed = [r for r in range(len(rows)) if num[r] > j + 1]  # rows that need draft j + 2
            if not feed:
                break
            index = torch.tensor(feed, device=self.device)
            token_ids = sample.token_ids.tolist()
            out_normed, out_prenorm = self._run(
                [token_ids[r] for r in feed],
                [pos[r] + j - 1 for r in feed],  # draft j + 1 sits at pos + j: fed one position before it
                prenorm[index],
                [1] * len(feed),
                [tables[r] for r in feed],
            )
            if len(feed) == len(rows):
                normed, prenorm = out_normed, out_prenorm
            else:  # the other rows are done: their stale states are never sampled into a kept draft
                normed, prenorm = normed.clone(), prenorm.clone()
                normed[index], prenorm[index] = out_normed, out_prenorm
        tokens = torch.stack(step_tokens, dim=1).tolist()  # [rows, steps run]
        for r, i in enumerate(rows):
            drafts[i] = tokens[r][: num[r]]
            if step_dists[0] is not None and num[r]:
                dists[i] = torch.stack([d[r] for d in step_dists[: num[r]]])  # [num[r], vocab_size]
        return DraftOutput(drafts, dists)
