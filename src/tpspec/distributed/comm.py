"""Every collective in tpspec goes through here, so calls and bytes are counted per call site.

Bytes are those of the collective's result on one rank (for an all-gather, the gathered tensor),
so "8·tp bytes per draft row" is read straight off the counters. At TP 1 nothing crosses a wire
and nothing is counted. Sampling sites also count the rows they sample (``count_rows``, at any
TP size), so bytes per sampled row are bytes / rows.
"""

from __future__ import annotations

import pickle
from collections import defaultdict

import torch
import torch.distributed as dist

from tpspec.distributed.parallel_state import get_state

_CALLS: dict[str, int] = defaultdict(int)
_BYTES: dict[str, int] = defaultdict(int)
_CROSS_NODE_BYTES: dict[str, int] = defaultdict(int)
_ROWS: dict[str, int] = defaultdict(int)


def _count(site: str, nbytes: int) -> None:
    _CALLS[site] += 1
    _BYTES[site] += nbytes
    if get_state().nnodes > 1:
        _CROSS_NODE_BYTES[site] += nbytes


def get_comm_stats() -> dict[str, dict[str, int]]:
    """``{site: {"calls": n, "bytes": b, "cross_node_bytes": c}}`` for this rank since the last reset."""
    return {
        site: {"calls": _CALLS[site], "bytes": _BYTES[site], "cross_node_bytes": _CROSS_NODE_BYTES[site]}
        for site in sorted(_CALLS)
    }


def count_rows(site: str, rows: int) -> None:
    """Record that ``site`` sampled ``rows`` more rows (the denominator of bytes per row)."""
    _ROWS[site] += rows


def get_row_stats() -> dict[str, int]:
    """``{site: rows sampled}`` for this rank since the last reset."""
    return {site: _ROWS[site] for site in sorted(_ROWS)}


def reset_comm_stats() -> None:
    _CALLS.clear()
    _BYTES.clear()
    _CROSS_NODE_BYTES.clear()
    _ROWS.clear()


def all_reduce(x: torch.Tensor, site: str) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place."""
    st = get_state()
    if st.world_size == 1:
        return x
    if st.shm is not None and st.shm.fits(x):
        st.shm.all_reduce_(x)
    else:
        dist.all_reduce(x, group=st.group)
    _count(site, x.numel() * x.element_size())
    return x


def all_gather(x: torch.Tensor, site: str, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``."""
    st = get_state()
    if st.world_size == 1:
        return x
    x = x.contiguous()
    if st.shm is not None and st.shm.fits(x):
        out = st.shm.all_gather(x)
    else:
        out = torch.empty((st.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x, group=st.group)
    _count(site, out.numel() * out.element_size())
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(st.world_size), dim=dim)


def broadcast_object(obj: object, site: str, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank over the gloo control group."""
    st = get_state()
    if st.world_size == 1:
        return obj
    if st.rank == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=st.cpu_group)
    if st.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=st.cpu_group)
    _count(site, 8 + payload.numel())
    return obj if st.rank == src else pickle.loads(payload.numpy().tobytes())
