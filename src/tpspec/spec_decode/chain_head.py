"""``ChainHeadProposer``: the drafting loop of a one-layer head that chains from the target's hidden
states (EAGLE-3, ``spec_decode/eagle.py``; MTP, ``spec_decode/mtp.py``), with its own paged KV cache
addressed by the target's block tables (draft KV valid below the target's computed tokens,
rewritten by refeeding).

Row t of the head pairs the target's hidden state at position t (as the head takes it) with the
embedding of token t + 1 and sits at position t; its output predicts token t + 2. So each step
first refeeds, per sequence, every kept position whose next token is known: for a proposing
sequence with tokens ``x_s … x_n`` (x_n the new bonus/recovered token) rows s … n − 1, the last of
which yields draft 1 (position n + 1). Draft j + 1 then comes from a row at position n + j − 1
that feeds draft j with the previous row's pre-norm output in place of the target's hidden state.
The k − 1 chained rows sit at positions n … n + k − 2, inside the k lookahead slots the scheduler
reserves.

A sequence that proposes no drafts this step (k = 0) puts its refeed off: its rows wait in its
``DraftState`` (``DeferredRows``) and are fed in one batch with the step in which it proposes
again, so steps without speculation cost the head nothing. Past ``max_deferred_tokens`` rows the
oldest are dropped unfed (down to half as many) and the head's attention for that sequence starts after them
(``DraftState.context_start``, the keys' first position): a request held at k = 0 for good never
runs the head, one that proposes again feeds at most that many rows first.

A partial prefill chunk ``x_s … x_e`` feeds rows s … e − 1 at once; its last row needs x_{e+1}, which
the next chunk brings, so that row waits (its target features kept) and is fed with the next chunk.
The head's KV is therefore written at every computed position but those it put off (``lag``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from tpspec.layers.attention import AttentionMetadata
from tpspec.spec_decode.speculator import DraftInput, DraftModelSpeculator, DraftState


@dataclass
class DeferredRows:
    """Rows of one sequence the head has not fed yet (consecutive positions). The last row may
    still wait for its next token (the end of a partial prefill chunk): then ``ids`` is one short."""

    ids: list[int]  # [n] or [n − 1] token t + 1 of row t
    positions: list[int]  # [n]
    features: list[torch.Tensor]  # per step deferred: [n_step, feature_width] target features

    def drop_oldest(self, keep: int) -> None:
        """Keep the newest ``keep`` rows (all of them ready: a sampled step's rows)."""
        tail, rows = [], 0  # the newest steps' features that hold them
        for step in reversed(self.features):
            tail.append(step)
            rows += step.shape[0]
            if rows >= keep:
                break
        features = torch.cat(tail[::-1])[-keep:]  # a copy of those steps alone: the dropped rows' features are freed
        self.ids, self.positions, self.features = self.ids[-keep:], self.positions[-keep:], [features]

    def split_ready(self) -> tuple[list[int], list[int], torch.Tensor, "DeferredRows | None"]:
        """The rows whose next token is known (ids, positions, features [rows, feature_width]), and
        the row still waiting, if any (its features copied: a view would keep the step's captured
        hidden states alive)."""
        features = self.features[0] if len(self.features) == 1 else torch.cat(self.features)
        n = len(self.ids)
        waiting = None
        if n < len(self.positions):
            waiting = DeferredRows([], self.positions[n:], [features[n:].clone()])
        return self.ids, self.positions[:n], features[:n], waiting


class ChainHeadProposer(DraftModelSpeculator):
    """Subclasses build ``self.model`` and define the three hooks below."""

    feature_width: int  # width of the target features the runner hands over per token
    hidden_size: int  # the head's hidden state

    def _hidden(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [rows, feature_width] -> the head's input hidden state [rows, H]."""
        raise NotImplementedError

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, md: AttentionMetadata, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward (ids, positions [rows], hidden [rows, H]); ``step``: 0 for the rows fed
        target features, j for chain step j. Returns (normed, prenorm) [rows, H]."""
        raise NotImplementedError

    def _run(
        self, ids: list[int], positions: list[int], hidden: torch.Tensor, query_lens: list[int], tables: list[list[int]],
        first_keys: list[int] | None = None, step: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over the rows of several sequences (``query_lens[i]`` consecutive rows
        each, the last at the sequence's newest position; its keys from ``first_keys[i]`` on, None:
        all); returns (normed, prenorm) [rows, H]."""
        context_lens = [positions[e - 1] + 1 for e in accumulate(query_lens)]  # each sequence's last row's
        md = AttentionMetadata.build(query_lens, context_lens, tables, self.engine_config.cache.block_size, self.device,
                                     first_keys=first_keys)
        return self._forward(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            hidden, md, step,
        )

    def _dummy_run(self, hidden: torch.Tensor, query_len: int) -> torch.Tensor:
        rows = hidden.shape[0]
        md, positions = self.dummy_metadata(rows, query_len)
        ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
        normed, _ = self._forward(ids, positions, hidden, md, 0)
        return normed

    def dummy_feed(self, num_rows: int) -> None:
        features = torch.zeros(num_rows, self.feature_width, dtype=self.model.dtype, device=self.device)
        self._dummy_run(self._hidden(features), self.num_speculative_tokens + 1)

    def dummy_pass(self, num_rows: int) -> None:
        hidden = torch.zeros(num_rows, self.hidden_size, dtype=self.model.dtype, device=self.device)
        self.dummy_sample(self._dummy_run(hidden, 1))

    def _feed_deferred(self, state: DraftState, block_table: list[int]) -> int:
        ids, positions, features, state.deferred = state.deferred.split_ready()
        if ids:
            self._run(ids, positions, self._hidden(features), [len(ids)], [block_table], [state.context_start])
        return len(ids)

    @torch.inference_mode()
    def _propose(self, inp: DraftInput, states: list[DraftState]) -> int:
        # 1. Refeed: row t = (features at t, token t + 1) at position t, for every kept t whose next
        # token is known, of the proposing sequences (with what they deferred) and of partial
        # prefill chunks (whose last row waits); the other sequences defer theirs.
        ids, positions, feature_chunks, fed, lens = [], [], [], [], []
        held: list[DeferredRows] = []  # deferring this step's rows as views of the step's features
        offset = 0
        for i, tokens in enumerate(inp.token_ids):
            n = inp.num_context(i)  # rows this step adds: one per kept token the target ran
            features = inp.target_features[offset : offset + n]  # [n, F]
            offset += n
            rows, states[i].deferred = states[i].deferred, None
            if rows is None:
                rows = DeferredRows([], [], [])
            # Extended in place: a step adds its rows, nothing is copied again. A row waiting for its
            # next token (a partial chunk's last) gets this step's first token.
            rows.ids += tokens if len(rows.ids) < len(rows.positions) else tokens[1:]
            rows.positions += range(inp.start_pos[i], inp.start_pos[i] + n)
            rows.features.append(features)
            if inp.num_drafts[i] == 0 and inp.sampled[i]:
                if len(rows.positions) > self.max_deferred_tokens:
                    rows.drop_oldest(self.kept_after_drop)
                    states[i].context_start = rows.positions[0]
                else:
                    held.append(rows)
                states[i].deferred = rows if rows.positions else None
                continue
            if not rows.positions:
                continue
            ready_ids, ready_pos, ready_features, states[i].deferred = rows.split_ready()
            if ready_ids:
                ids += ready_ids
                positions += ready_pos
                feature_chunks.append(ready_features)
                fed.append(i)
                lens.append(len(ready_ids))
        if held:  # their rows copied in one piece: a view would keep the whole step's features alive
            copies = torch.cat([rows.features[-1] for rows in held]).split([rows.features[-1].shape[0] for rows in held])
            for rows, copy in zip(held, copies):
                rows.features[-1] = copy
        if not fed:
            return len(positions)
        features = torch.cat(feature_chunks)  # [rows, F]
        normed, prenorm = self._run(ids, positions, self._hidden(features), lens, [inp.block_tables[i] for i in fed],
                                    [states[i].context_start for i in fed])
        rows = inp.proposing  # every proposing sequence has >= 2 tokens: fed
        if not rows:
            return len(positions)
        end_of = {i: end - 1 for i, end in zip(fed, accumulate(lens))}  # each fed sequence's last row
        last = torch.tensor([end_of[i] for i in rows], device=self.device)
        normed, prenorm = normed[last], prenorm[last]  # [len(rows), H]
        # 2. Chain: draft j + 1 from a row at position n + j - 1 feeding draft j (n: the bonus token's position).
        pos, tables, num = self.chain_rows(inp, rows)  # position of draft 1, block table, drafts per row
        if not any(num):
            return len(positions)
        drafting = [r for r, n in enumerate(num) if n]
        carried = prenorm if len(drafting) == len(num) else prenorm[torch.tensor(drafting, device=self.device)]

        def advance(active: list[int], keep: list[int], tokens: list[int], j: int) -> torch.Tensor:
            # Draft j + 2 comes from the row that feeds draft j + 1 one position before it (pos + j − 1),
            # with the previous row's pre-norm output in place of target features.
            nonlocal carried
            if len(keep) < carried.shape[0]:  # some rows stopped drafting
                carried = carried[torch.tensor(keep, device=self.device)]
            normed_next, carried = self._run(
                tokens, [pos[r] + j - 1 for r in active], carried,
                [1] * len(active), [tables[r] for r in active], [states[rows[r]].context_start for r in active],
                step=j + 1,
            )
            return normed_next

        chain, chain_dists = self.draft_chain(normed, num, pos, inp.sampling, advance, self.grammars_of(inp, rows))
        for r, i in enumerate(rows):
            states[i].draft_ids, states[i].draft_dists = chain[r], chain_dists[r]
        return len(positions)
