"""The rank's grammars: one ``RequestGrammar`` per constrained request, from admission to its end.

Each rank compiles the request's constraint itself (a cache hit in the driver's process, where
the driver compiled it first; a TP worker compiles it once per distinct grammar) and follows the
request's tokens, so its masks equal every other rank's without any exchange.
"""

from __future__ import annotations

import os

import torch

from tpspec.config import EngineConfig
from tpspec.sample.token_bitmask import words_for
from tpspec.structured.grammar import grammar_compiler
from tpspec.structured.request_grammar import RequestGrammar
from tpspec.worker.step import NewRequest


class RankGrammars:
    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer_path = os.path.join(config.model, "tokenizer.json")
        self.vocab_size = config.arch.vocab_size
        self.words = words_for(self.vocab_size)
        self.by_req: dict[str, RequestGrammar] = {}

    def add(self, new: NewRequest) -> None:
        so = new.params.structured_outputs
        if so is None:
            return
        stops = sorted(new.eos_token_ids | set(new.params.stop_token_ids))
        compiler = grammar_compiler(self.tokenizer_path, self.vocab_size, sorted(new.eos_token_ids))
        self.by_req[new.req_id] = RequestGrammar(compiler.matcher(so), self.words, stops)

    def forget(self, req_id: str) -> None:
        self.by_req.pop(req_id, None)

    def get(self, req_id: str) -> RequestGrammar | None:
        return self.by_req.get(req_id)

    def __len__(self) -> int:
        return len(self.by_req)

    def verify_bitmask(self, req_ids: list[str], num_spec: list[int]) -> torch.Tensor | None:
        """The masks of a step's sampled rows, ``num_spec[i] + 1`` per sampled sequence ``i``
        (its verified drafts and the token after them): ``[rows, words]`` int32, all ones for an
        unconstrained request; None when none is constrained."""
        grammars = [self.by_req.get(r) for r in req_ids]
        if not any(g is not None for g in grammars):
            return None
        parts = [
            g.verify_masks(n) if g is not None else torch.full((n + 1, self.words), -1, dtype=torch.int32)
            for g, n in zip(grammars, num_spec)
        ]
        return torch.cat(parts)

    def accept(self, req_id: str, tokens: list[int]) -> None:
        g = self.by_req.get(req_id)
        if g is not None and tokens:
            g.accept(tokens)
