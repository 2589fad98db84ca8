"""What every node of a multi-node engine must agree on, as flat ``{field: value}`` strings.

Each node builds its own ``EngineConfig`` from its own flags and loads the model from its own
disk; before any rank joins the TP group, the head compares every node's fingerprint with its own
and refuses a node that differs, naming the field, instead of leaving the ranks to hang (or
compute garbage) in a collective. Paths are local, so a model or drafter is compared by its
files: the sizes of all of them and a hash of everything but the weights (config, tokenizer,
generation config). Where the node itself sits (its rank, the head's address it dialled, how long
it waits) is its own business and left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version

from tpspec.config import EngineConfig

# Files compared by size only: hashing gigabytes of weights at start-up would cost more than it finds.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# A single-file checkpoint (.gguf): its size and the hash of its head, which holds the metadata
# (architecture, tokenizer) before the tensors.
FILE_HEAD_BYTES = 1 << 20
# ParallelConfig fields that are a node's own.
LOCAL_FIELDS = ("parallel.node_rank", "parallel.master_addr", "parallel.master_port", "parallel.distributed_timeout_s")


def files_digest(path: str) -> str:
    """``"N files, B bytes, sha256 H"``: a folder's files (weights by size), or a single file."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        with open(path, "rb") as f:
            h.update(f.read(FILE_HEAD_BYTES))
        return f"1 file, {os.path.getsize(path)} bytes, sha256 of the first MiB {h.hexdigest()[:16]}"
    total = count = 0
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            size = os.path.getsize(full)
            total, count = total + size, count + 1
            h.update(f"{rel}\0{size}\0".encode())
            if not name.endswith(WEIGHT_SUFFIXES):
                with open(full, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return f"{count} files, {total} bytes, sha256 {h.hexdigest()[:16]}"


def _flatten(prefix: str, value, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(f"{prefix}.{k}" if prefix else str(k), value[k], out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True, default=str)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def config_fingerprint(config: EngineConfig, device_kind: str) -> dict[str, str]:
    """The fields (dotted names, e.g. ``parallel.tensor_parallel_size``) a node must share with the head."""
    import torch

    raw = dataclasses.asdict(config)
    raw["model"] = files_digest(config.model)
    if config.speculative is not None and config.speculative.model is not None:
        raw["speculative"]["model"] = files_digest(config.speculative.model)
    out: dict[str, str] = {}
    _flatten("", raw, out)
    for name in LOCAL_FIELDS:
        out.pop(name)
    out["device"] = json.dumps(device_kind)
    out["version.tpspec"] = json.dumps(_version("tpspec"))
    out["version.torch"] = json.dumps(torch.__version__)
    return out


def mismatches(head: dict[str, str], node: dict[str, str]) -> list[str]:
    """One line per differing field: ``dtype: "bfloat16" on the node, "float32" on the head``."""
    lines = []
    for name in sorted(set(head) | set(node)):
        there, here = node.get(name, "(not set)"), head.get(name, "(not set)")
        if there != here:
            lines.append(f"{name}: {there} on the node, {here} on the head")
    return lines
