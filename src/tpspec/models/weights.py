"""Checkpoint tensor names → our parameters, with q/k/v and gate/up packed into one matrix."""

from __future__ import annotations

from torch import nn


def checkpoint_target(model: nn.Module, name: str, packed: dict[str, tuple[str, object]]):
    """Map a checkpoint name (e.g. ``layers.0.self_attn.k_proj.weight``) to
    ``(our parameter name, module, parameter, shard id)``; ``packed`` maps a checkpoint sub-name
    to (our sub-name, shard id). An unknown name raises ValueError."""
    shard = None
    parts = name.split(".")
    for ckpt, (ours, sid) in packed.items():
        if ckpt in parts:
            parts[parts.index(ckpt)] = ours
            shard = sid
            break
    *mod_path, pname = parts
    try:
        module = model.get_submodule(".".join(mod_path))
        param = getattr(module, pname)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}") from None
    return ".".join(parts), module, param, shard
