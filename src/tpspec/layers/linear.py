"""Tensor-parallel linear layers. Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``.

Weight loaders receive a lazily sliceable checkpoint tensor (a safetensors slice or a tensor) and
copy only this rank's shard, so a rank never materializes another rank's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.partition import head_partition, split_range
from tpspec.layers.cpu_weights import PackedCPUWeight


def _rows(loaded, start: int, end: int) -> torch.Tensor:
    return loaded[start:end]


def _cols(loaded, start: int, end: int) -> torch.Tensor:
    return loaded[:, start:end]


class LinearBase(PackedCPUWeight, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        return self.linear(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Y = X·Aᵀ + b, A whole on every rank."""

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(loaded[:])


class ColumnParallelLinear(LinearBase):
    """Y = X·Aᵀ + b, A split along the output dim; each rank returns its slice of Y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.out_range = split_range(out_features, self.tp_size, self.tp_rank)
        super().__init__(in_features, self.out_range[1] - self.out_range[0], bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(_rows(loaded, *self.out_range))


class MergedColumnParallelLinear(LinearBase):
    """[Y₀ | Y₁ | …] = X·[A₀ | A₁ | …]ᵀ, each Aᵢ split along the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=torch.float32):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.ranges = [split_range(n, self.tp_size, self.tp_rank) for n in output_sizes]
        self.local_sizes = [b - a for a, b in self.ranges]
        super().__init__(in_features, sum(self.local_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        offset = sum(self.local_sizes[:shard_id])
        size = self.local_sizes[shard_id]
        param.data[offset : offset + size].copy_(_rows(loaded, *self.ranges[shard_id]))


class QKVParallelLinear(LinearBase):
    """[Q | K | V] = X·[A_q | A_k | A_v]ᵀ, split by attention head (query heads as evenly as possible,
    each rank holding the KV heads its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, dtype=torch.float32):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        (q0, q1), (k0, k1) = head_partition(num_heads, num_kv_heads, self.tp_size, self.tp_rank)
        self.head_dim = head_dim
        self.q_heads, self.kv_heads = (q0, q1), (k0, k1)
        self.num_local_heads, self.num_local_kv_heads = q1 - q0, k1 - k0
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst, (h0, h1) = param.data[: self.q_size], self.q_heads
        elif shard_id == "k":
            dst, (h0, h1) = param.data[self.q_size : self.q_size + self.kv_size], self.kv_heads
        else:
            dst, (h0, h1) = param.data[self.q_size + self.kv_size :], self.kv_heads
        dst.copy_(_rows(loaded, h0 * d, h1 * d))


class RowParallelLinear(LinearBase):
    """Y = X·Aᵀ + b, A split along the input dim; partial results summed with one all-reduce.

    ``input_range`` gives this rank's slice of the input dim when it is not an even split
    (e.g. the attention output projection under an uneven head split).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype=torch.float32,
        input_range: tuple[int, int] | None = None,
        reduce_results: bool = True,
    ):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_range = input_range or split_range(in_features, self.tp_size, self.tp_rank)
        self.reduce_results = reduce_results
        super().__init__(self.in_range[1] - self.in_range[0], out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0
            param.data.copy_(loaded[:] if self.tp_rank == 0 else torch.zeros(param.shape))
        else:
            param.data.copy_(_cols(loaded, *self.in_range))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, local in_features]
        y = self.linear(x, self.bias)
        return comm.all_reduce(y, "layer.all_reduce") if self.reduce_results else y
