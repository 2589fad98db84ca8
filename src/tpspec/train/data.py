"""Self-distillation data for a drafter: prompts from offline text, the target's own continuations,
and the target's hidden states and predictions on them.

Stages, each resumable (a stage writes numbered shard files atomically and skips those present):
1. ``stdlib_prompts``: HumanEval-shaped prompts (a function's signature and docstring) cut from the
   Python standard library's sources; any function named like a HumanEval problem is dropped, so
   HumanEval stays held out.
2. ``generate_shards``: the target's greedy continuations of those prompts (tpspec's own engine).
3. ``feature_shards``: one target forward over each prompt + continuation, keeping the hidden
   states at the drafter's ``target_layer_ids`` and the target's argmax prediction at every
   position (the labels: what the target would emit next).
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import os
import random
import sysconfig
import textwrap

import torch
from tqdm import tqdm

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


def stdlib_prompts(seed: int = 0) -> list[str]:
    """Every documented function of the standard library as a HumanEval-shaped prompt, shuffled."""
    root = sysconfig.get_paths()["stdlib"]
    held_out = _humaneval_entry_points()
    prompts: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in held_out:
                    prompt = _function_prompt(source, node)
                    if prompt is not None:
                        prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    return prompts


def stdlib_sources(seed: int = 0) -> list[str]:
    """The standard library's Python files (tests and IDLE left out), as text, shuffled."""
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                try:
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        texts.append(f.read())
                except UnicodeDecodeError:
                    continue
    random.Random(seed).shuffle(texts)
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
        if not os.path.exists(path):
            chunk = seqs[i : i + shard_size]
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
) -> None:
    """Greedy continuations, ``shard_size`` prompts per shard: {"prompt_ids", "output_ids"} lists."""
    from tpspec.llm import LLM
    from tpspec.sampling_params import SamplingParams

    os.makedirs(folder, exist_ok=True)
    num_shards = (len(prompts) + shard_size - 1) // shard_size
    todo = [i for i in range(num_shards) if not os.path.exists(_shard_path(folder, i))]
    if not todo:
        return
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with LLM(**(engine_args or {})) as llm:
        for i in tqdm(todo, desc="generating continuations (shards)"):
            outs = llm.generate(prompts[i * shard_size : (i + 1) * shard_size], params, use_tqdm=False)
            _save_atomic(
                {"prompt_ids": [o.prompt_token_ids for o in outs], "output_ids": [list(o.outputs[0].token_ids) for o in outs]},
                _shard_path(folder, i),
            )


def feature_shards(
    gen_folder: str, folder: str, model_folder: str, target_layer_ids: tuple[int, ...], batch_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Per generated shard: tokens, the target's features (bfloat16) and argmax."""
    from tpspec.train.target_features import TargetFeatureExtractor

    os.makedirs(folder, exist_ok=True)
    gen = sorted(f for f in os.listdir(gen_folder) if f.startswith("shard_") and f.endswith(".pt"))
    todo = [f for f in gen if not os.path.exists(os.path.join(folder, f))]
    if not todo:
        return
    extractor = TargetFeatureExtractor(model_folder, target_layer_ids, dtype)
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
                feats.append(f.to(torch.bfloat16))
                preds.append(p.to(torch.int32))
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
