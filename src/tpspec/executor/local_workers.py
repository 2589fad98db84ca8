"""This node's TP worker processes: started, waited for, watched and stopped.

Workers are forks of this process's fork server (``fork_server``): started at once, never
re-importing the user's main module, with the engine's environment. Each joins the TP group,
loads its shard and then runs whatever rank 0 broadcasts (``ModelRunner`` calls) until told to
shut down. Workers die with the fork server, and it with the process that started it: the
engine's driver on the head node, the node agent (``tpspec serve --headless``) on the others.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import destroy_distributed, init_distributed
from tpspec.executor.fork_server import ForkedProcess, fork_server
from tpspec.worker.model_runner import ModelRunner


class EngineDeadError(RuntimeError):
    """A TP worker died or a collective failed: the engine cannot continue."""


def rank_device(kind: str, config: EngineConfig, rank: int) -> torch.device:
    """The device of global TP ``rank`` on its own node (CUDA devices are numbered per node)."""
    return torch.device("cuda", rank % config.parallel.ranks_per_node) if kind == "cuda" else torch.device("cpu")


def check_cuda_devices(config: EngineConfig, device_kind: str) -> None:
    """``ValueError`` unless this node has a CUDA device for each of its ranks."""
    n = config.parallel.ranks_per_node
    if device_kind == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={config.parallel.tensor_parallel_size} needs one CUDA device per rank: {n} on "
            f"this node; {torch.cuda.device_count()} visible"
        )


def threads_per_rank(config: EngineConfig) -> int:
    """Intra-op threads per rank: ``OMP_NUM_THREADS`` when set (e.g. 1 beside a busy HTTP thread),
    else this node's CPUs shared out among its ranks."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, (os.cpu_count() or 1) // config.parallel.ranks_per_node)


def _worker_main(
    rank: int, config: EngineConfig, device_kind: str, init_method: str, environ: dict[str, str], ready_fd: int
) -> None:
    os.environ.clear()  # the engine's environment, not the fork server's (taken when it started)
    os.environ.update(environ)
    # Ctrl-C in a terminal reaches the whole process group. It is the parent's to handle (it shuts
    # the workers down, or kills them when the interrupt cut a step short); a worker quitting on
    # its own would leave mid-collective and race the driver's handling with a dead-worker error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[tpspec worker {rank}] %(levelname)s %(message)s")
    torch.set_num_threads(threads_per_rank(config))
    try:
        device = rank_device(device_kind, config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.write(ready_fd, b".")  # about to join the TP group (see LocalWorkers.wait_until_joining)
        os.close(ready_fd)
        p = config.parallel
        init_distributed(rank, p.tensor_parallel_size, init_method, p.backend, device, p.worker_timeout_s, p.nnodes)
        runner = ModelRunner(config, device)
        runner.load_model()
        while True:
            kind, arg = comm.broadcast_object(None, "rpc")
            if kind == "shutdown":
                break
            if kind == "execute":
                runner.execute(arg)
            elif kind == "call":
                getattr(runner, arg)()
            elif kind == "ready":
                pass
    except Exception:  # the driver sees the closed connection; log why this rank went away
        logging.getLogger(__name__).error("worker %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    destroy_distributed()
    # Told to shut down and out of the group: nothing is left to clean up, and the interpreter's
    # own teardown (torch's modules) would add about 0.4 s to every engine shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalWorkers:
    """The worker processes of global ``ranks`` on this node."""

    def __init__(self, config: EngineConfig, device_kind: str, ranks: range, init_method: str) -> None:
        self.config = config
        self.ranks = list(ranks)
        self.procs: list[ForkedProcess] = []
        self.stopping = False  # set by stop(): exits from then on are expected
        self._watchdogs: list[threading.Thread] = []
        ready_r, ready_w = os.pipe()
        self._ready_fd = ready_r
        try:
            server = fork_server()
            for rank in self.ranks:
                args = (rank, config, device_kind, init_method, dict(os.environ))
                self.procs.append(server.start(_worker_main, args, fds=(ready_w,)))
        except BaseException:
            os.close(ready_r)
            self.stop(graceful=False)
            raise
        finally:
            os.close(ready_w)  # the workers hold their own copies

    def describe(self, i: int) -> str:
        return f"TP worker rank {self.ranks[i]} (pid {self.procs[i].pid})"

    def check(self) -> None:
        """Raise ``EngineDeadError`` if a worker has exited."""
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise EngineDeadError(f"{self.describe(i)} exited with exit code {p.exitcode}; see its log above")

    def wait_until_joining(self, timeout_s: float) -> None:
        """Wait until every worker is about to join the TP group (it writes a byte to the ready
        pipe); one that exits first (bad device, import error, killed) fails the start at once.
        Rank 0 only joins after that: an init_process_group left waiting for a dead rank would
        break every later one in its process."""
        missing = len(self.procs)
        deadline = time.monotonic() + timeout_s
        try:
            while missing:
                if select.select([self._ready_fd], [], [], 0.05)[0]:
                    data = os.read(self._ready_fd, missing)
                    missing -= len(data)
                    if not data:  # every worker closed its end: some exited without reporting
                        time.sleep(0.01)
                for i, p in enumerate(self.procs):
                    if p.exitcode is not None:
                        raise EngineDeadError(f"{self.describe(i)} exited with exit code {p.exitcode} before "
                                              "joining the TP group; see its log above")
                if missing and time.monotonic() > deadline:
                    raise EngineDeadError(f"TP workers did not start within {timeout_s:g} s")
        finally:
            os.close(self._ready_fd)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """A watchdog thread per worker: ``on_death(reason)`` when one exits before ``stop`` with a
        failure (a worker exits 0 only once rank 0 broadcast the shutdown)."""
        for i in range(len(self.procs)):
            t = threading.Thread(target=self._watch, args=(i, on_death), name=f"tpspec-watchdog-{self.ranks[i]}",
                                 daemon=True)
            t.start()
            self._watchdogs.append(t)

    def _watch(self, i: int, on_death: Callable[[str], None]) -> None:
        code = self.procs[i].wait()
        if not self.stopping and code != 0:
            on_death(f"{self.describe(i)} died with exit code {code}")

    def stop(self, graceful: bool, timeout_s: float = 5.0) -> list[int | None]:
        """Reap the workers: wait up to ``timeout_s`` for those told to shut down (``graceful``),
        kill the rest; returns the exit codes."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if graceful and p.wait(max(0.0, deadline - time.monotonic())) is not None:
                continue
            p.kill()  # out of step with us (or stuck): it cannot stop by itself
            p.wait()
        for t in self._watchdogs:  # they return once their worker exited: before its status pipe closes
            if t is not threading.current_thread():
                t.join(timeout=1.0)
        for p in self.procs:
            p.close()
        return [p.exitcode for p in self.procs]
