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
    bytes for each draft pass to read. Row-parallel layers keep theirs: a TP split of their input
    could cut Q4_1's 32-weight groups, and the drafter's numbers must not depend on the TP size
    (sharding invariance); every other layer splits whole output rows. Lossy, but drafts are
    verified. Returns how many weights were rounded."""
    borrowed = {p.data_ptr() for p in target.parameters()}
    rounded = 0
    for module in drafter.modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, PackedCPUWeight) and not isinstance(module, RowParallelLinear)
                and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
                and w.shape[1] % q4_1.GROUP == 0 and w.data_ptr() not in borrowed):
            with torch.no_grad():
                w.copy_(q4_1.round_to_q4_1(w))
            rounded += 1
    return rounded
