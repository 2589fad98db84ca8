"""Tensor-parallel process groups: one group for tensors (gloo on CPU, NCCL on CUDA) and one
gloo group for host-side control messages."""

from __future__ import annotations

import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tpspec.distributed.shm_comm import ShmCommunicator, shm_available

SHM_MAX_BYTES = 8 << 20  # per rank and slot; larger collectives go through gloo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: object | None  # tensor collectives
    cpu_group: object | None  # pickled control messages (always gloo)
    shm: ShmCommunicator | None = None  # CPU ranks on one node: shared-memory all-reduce / all-gather
    nnodes: int = 1  # the nodes the group spans: every collective crosses nodes when > 1


_STATE = ParallelState(0, 1, torch.device("cpu"), "none", None, None)


def get_free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int, world_size: int, init_method: str, backend: str, device: torch.device, timeout_s: float,
    nnodes: int = 1,
) -> ParallelState:
    """Join the TP group. ``world_size == 1`` creates no process group at all. CPU ranks all on one
    node (``nnodes == 1``) also share a shared-memory communicator; across nodes every collective
    goes through ``backend``."""
    global _STATE
    if world_size == 1:
        _STATE = ParallelState(0, 1, device, "none", None, None)
        return _STATE
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    shm = _init_shm(rank, world_size, timeout_s) if device.type == "cpu" and nnodes == 1 and shm_available() else None
    _STATE = ParallelState(rank, world_size, device, backend, dist.group.WORLD, cpu_group, shm, nnodes)
    logger.debug("rank %d/%d joined (%s)", rank, world_size, backend)
    return _STATE


def _init_shm(rank: int, world_size: int, timeout_s: float) -> ShmCommunicator:
    """Rank 0 creates the segment, the others map it, then it is unlinked at once."""
    if rank == 0:
        name = ShmCommunicator.new_name()
        shm = ShmCommunicator(0, world_size, name, True, SHM_MAX_BYTES, timeout_s)
    box = [name if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # only once the segment exists
    if rank != 0:
        shm = ShmCommunicator(rank, world_size, box[0], False, SHM_MAX_BYTES, timeout_s)
    dist.barrier()
    if rank == 0:
        shm.unlink()
    return shm


def destroy_distributed() -> None:
    global _STATE
    if _STATE.shm is not None:
        _STATE.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState(0, 1, _STATE.device, "none", None, None)


def get_state() -> ParallelState:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.world_size


@contextmanager
def single_rank():
    """Run the enclosed code as if TP were 1 (a replicated draft model: no sharding, no collectives)."""
    global _STATE
    saved = _STATE
    _STATE = ParallelState(0, 1, saved.device, "none", None, None)
    try:
        yield
    finally:
        _STATE = saved
