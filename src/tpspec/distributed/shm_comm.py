"""Shared-memory all-reduce and all-gather for CPU ranks on one host.

Gloo over loopback costs ~1.6 ms per small all-reduce on this machine kind, and a decode step
makes two per layer. Here every rank copies its tensor into its own slot of a shared buffer,
bumps its sequence counter, waits until every rank has bumped it, and reduces (or concatenates)
the slots in rank order, so every rank gets bit-identical results. Two slot sets alternate, so
a rank that runs ahead never overwrites a slot another rank is still reading (it cannot pass
the next step's wait before everyone finished reading this one). x86 keeps stores in order, and
the counter is written after the data.

The segment has a random name, is unlinked as soon as every rank has mapped it (nothing is left
behind, even after a crash), and waits give up when the executor reports a dead peer or after
``timeout_s``.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np
import torch

_HEADER = 64  # bytes per rank counter (own cache line)
SHM_DIR = "/dev/shm"


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR)


class ShmCommunicator:
    def __init__(self, rank: int, world_size: int, name: str, create: bool, max_bytes: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        size = world_size * _HEADER + 2 * world_size * max_bytes
        self.path = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        buf = memoryview(self._map)
        self._counters = np.ndarray((world_size, _HEADER // 8), dtype=np.int64, buffer=buf)
        self._data = torch.frombuffer(buf, dtype=torch.uint8, offset=world_size * _HEADER)  # [2·world·max_bytes]
        if create:
            self._counters[:] = 0
        self.seq = 0
        self.abort_reason: str | None = None  # set by the executor's watchdog when a peer dies

    @staticmethod
    def new_name() -> str:
        return f"tpspec-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._data = None
        self._counters = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.max_bytes

    def _slot(self, rank: int, nbytes: int) -> torch.Tensor:
        base = ((self.seq & 1) * self.world_size + rank) * self.max_bytes
        return self._data[base : base + nbytes]

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` and return every rank's tensor (views into shared memory), rank order."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        self.seq += 1
        self._slot(self.rank, nbytes).copy_(x.view(-1).view(torch.uint8))
        self._counters[self.rank, 0] = self.seq
        counters = self._counters[:, 0]
        spins = 0
        start = None
        while (counters < self.seq).any():
            spins += 1
            if spins > 64:
                # Several ranks per core (e.g. TP 4 on 2 cores): let the others run. On a busy core a
                # yield can hand it away for a whole time slice, so the lost peer and the timeout are
                # checked after every yield, not after a count of them (4,096 yields beside two busy
                # threads took seconds to notice a killed worker).
                os.sched_yield()
                if self.abort_reason:
                    raise RuntimeError(f"TP peer lost: {self.abort_reason}")
                now = time.monotonic()
                start = start or now
                if now - start > self.timeout_s:
                    raise RuntimeError(f"TP peer did not reach the collective within {self.timeout_s} s")
        return [self._slot(r, nbytes).view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x += every other rank's x, summed in rank order (identical result on every rank)."""
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along dim 0."""
        return torch.cat(self._exchange(x), dim=0)
