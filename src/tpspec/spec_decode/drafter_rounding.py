"""A shipped drafter's own weights rounded to Q4_1 under ``--quantization q4_1``, so that its
draft passes read a quarter of float16's bytes (which drafters: the methods table's
``rounds_shipped_drafter_to_q4_1``)."""

from __future__ import annotations

import torch
from torch import nn

from tpspec.layers import q4_1
from tpspec.layers.cpu_weights import PackedCPUWeight
from tpspec.layers.linear import RowParallelLinear


def round_drafter_to_q4_1(drafter: nn.Module, target: nn.Module) -> int:
    """Round, in place, the drafter's own float32 linear weights (not the target's that it
    borrows) to Q4_1, so that "q4_1" packs them in the Q4_1 kernel: about a quarter of float16's
    bytes for each draft pass to read. The drafter's numbers must not depend on the TP size
    (sharding invariance): a layer that splits whole output rows rounds the groups it would
    unsplit; a row-parallel layer is rounded only where its input slice starts on a 32-weight
    group boundary (its groups are then the unsplit weight's: the shipped EAGLE-3 head's o_proj
    splits by 64-wide heads, its down_proj 1,536 inputs evenly, at every TP size it allows).
    Lossy, but drafts are verified. Returns how many weights were rounded."""
    borrowed = {p.data_ptr() for p in target.parameters()}
    rounded = 0
    for module in drafter.modules():
        w = getattr(module, "weight", None)
        whole_groups = not isinstance(module, RowParallelLinear) or module.in_range[0] % q4_1.GROUP == 0
        if (isinstance(module, PackedCPUWeight) and whole_groups
                and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
                and w.shape[1] % q4_1.GROUP == 0 and w.data_ptr() not in borrowed):
            with torch.no_grad():
                w.copy_(q4_1.round_to_q4_1(w))
            rounded += 1
    return rounded
