"""Hugging Face checkpoint folders: ``config.json`` + ``*.safetensors`` (one file or a sharded index).

Tensors are handed out as lazy safetensors slices, so each rank reads only the rows or columns of
its own shards.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Iterator

from safetensors import safe_open
from tqdm import tqdm


def checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder!r}")
    return [os.path.join(folder, f) for f in files]


def iterate_weights(folder: str, show_progress: bool = True) -> Iterator[tuple[str, object]]:
    """Yield (tensor name, lazily sliceable tensor) over every checkpoint file of ``folder``."""
    files = checkpoint_files(folder)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        names = [(h, n) for h in handles for n in h.keys()]
        for h, name in tqdm(names, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False):
            yield name, h.get_slice(name)


def weight_names(folder: str) -> set[str]:
    """The names of every tensor in ``folder``'s checkpoint files (no tensor is read)."""
    names: set[str] = set()
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names
