"""Run a function on ``world_size`` gloo ranks (forks of the engine's fork server, a free port) and
collect results."""

from __future__ import annotations

import os
import pickle
import threading
import traceback

import torch

from tpspec.distributed.parallel_state import destroy_distributed, get_free_port, init_distributed
from tpspec.executor.fork_server import fork_server


def _entry(fn, rank, world_size, init_method, args, result_fd):
    status, value = "ok", None
    try:
        torch.set_num_threads(1)
        init_distributed(rank, world_size, init_method, "gloo", torch.device("cpu"), 120)
        value = fn(*args)
    except Exception:
        status, value = "error", traceback.format_exc()
    finally:
        destroy_distributed()
    with os.fdopen(result_fd, "wb") as f:
        pickle.dump((status, value), f)


def run_distributed(fn, world_size: int, *args, timeout: float = 120):
    """``fn(*args)`` on each rank; returns the per-rank results (rank order). ``fn`` must be picklable."""
    init_method = f"tcp://127.0.0.1:{get_free_port()}"
    server = fork_server()
    procs, readers, results = [], [], {}
    try:
        for rank in range(world_size):
            r, w = os.pipe()
            try:
                procs.append(server.start(_entry, (fn, rank, world_size, init_method, args), fds=(w,)))
            finally:
                os.close(w)
            readers.append(threading.Thread(target=lambda rank=rank, r=r: results.__setitem__(rank, _read(r)),
                                            daemon=True))
            readers[-1].start()
        for t in readers:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"ranks did not finish within {timeout:g} s")
    finally:
        for p in procs:
            if p.wait(10) is None:
                p.kill()
            p.close()
    out = []
    for rank in range(world_size):
        status, value = results.get(rank, ("error", "exited without a result"))
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out.append(value)
    return out


def _read(fd: int):
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    return pickle.loads(data) if data else ("error", "exited without a result")
