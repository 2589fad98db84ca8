"""Run a function on ``world_size`` gloo ranks (spawned processes, free port) and collect results."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import torch

from tpspec.distributed.parallel_state import destroy_distributed, get_free_port, init_distributed


def _entry(fn, rank, world_size, init_method, args, queue, received):
    try:
        torch.set_num_threads(1)
        init_distributed(rank, world_size, init_method, "gloo", torch.device("cpu"), 120)
        result = fn(*args)
        queue.put((rank, "ok", result))
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed()
        # A tensor in the queue travels as a shared-memory file descriptor that this process
        # hands over when the parent unpickles it: stay alive until the parent has them all.
        received.wait(60)
        os._exit(0)  # skip the interpreter's teardown (~0.4 s with torch loaded): nothing is left to flush


def run_distributed(fn, world_size: int, *args, timeout: float = 120):
    """``fn(*args)`` on each rank; returns the per-rank results (rank order). ``fn`` must be picklable."""
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    init_method = f"tcp://127.0.0.1:{get_free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, init_method, args, queue, received)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        received.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
