"""This node's TP worker processes: spawned, waited for, watched and stopped.

Workers are fresh interpreters (``python -m tpspec.executor.local_workers``) that read their
arguments from stdin, so they never re-import the user's main module (a script without an
``if __name__ == "__main__"`` guard works). Each joins the TP group, loads its shard and then
runs whatever rank 0 broadcasts (``ModelRunner`` calls) until told to shut down. Workers die
with the process that spawned them (PR_SET_PDEATHSIG): the engine's driver on the head node, the
node agent (``tpspec serve --headless``) on the others.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import destroy_distributed, init_distributed
from tpspec.worker.model_runner import ModelRunner


class EngineDeadError(RuntimeError):
    """A TP worker died or a collective failed: the engine cannot continue."""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


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
    rank: int, config: EngineConfig, device_kind: str, init_method: str, parent_pid: int, ready_fd: int
) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
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
        self.procs: list[subprocess.Popen] = []
        self.stopping = False  # set by stop(): exits from then on are expected
        ready_r, ready_w = os.pipe()
        self._ready_fd = ready_r
        try:
            for rank in self.ranks:
                p = subprocess.Popen(
                    [sys.executable, "-m", "tpspec.executor.local_workers"], stdin=subprocess.PIPE,
                    pass_fds=(ready_w,),
                )
                self.procs.append(p)
                p.stdin.write(pickle.dumps((rank, config, device_kind, init_method, os.getpid(), ready_w)))
                p.stdin.close()
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
            if p.poll() is not None:
                raise EngineDeadError(f"{self.describe(i)} exited with exit code {p.returncode}; see its log above")

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
                    if p.poll() is not None:
                        raise EngineDeadError(f"{self.describe(i)} exited with exit code {p.returncode} before "
                                              "joining the TP group; see its log above")
                if missing and time.monotonic() > deadline:
                    raise EngineDeadError(f"TP workers did not start within {timeout_s:g} s")
        finally:
            os.close(self._ready_fd)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """A watchdog thread per worker: ``on_death(reason)`` when one exits before ``stop`` with a
        failure (a worker exits 0 only once rank 0 broadcast the shutdown)."""
        for i in range(len(self.procs)):
            threading.Thread(target=self._watch, args=(i, on_death), name=f"tpspec-watchdog-{self.ranks[i]}",
                             daemon=True).start()

    def _watch(self, i: int, on_death: Callable[[str], None]) -> None:
        p = self.procs[i]
        if hasattr(os, "waitid"):
            # Wait without reaping: a thread blocked in p.wait() holds the Popen's lock, and at
            # interpreter exit (daemon threads frozen) it would keep stop()'s p.wait() from returning.
            try:
                info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            except ChildProcessError:  # already reaped by stop()
                code = p.returncode
        else:
            code = p.wait()
        if not self.stopping and code != 0:
            on_death(f"{self.describe(i)} died with exit code {code}")

    def stop(self, graceful: bool, timeout_s: float = 5.0) -> list[int | None]:
        """Reap the workers: wait up to ``timeout_s`` for those told to shut down (``graceful``),
        kill the rest; returns the exit codes."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if graceful:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    continue
                except subprocess.TimeoutExpired:
                    pass
            p.kill()  # out of step with us (or stuck): it cannot stop by itself
            p.wait()
        return [p.returncode for p in self.procs]


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
