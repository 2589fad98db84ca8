"""The driver (rank 0, in the engine's process) plus tp−1 worker processes.

Workers are fresh interpreters (``python -m tpspec.distributed.executor``) that read their
arguments from stdin, so they never re-import the user's main module (a script without an
``if __name__ == "__main__"`` guard works).

Each step the driver broadcasts the step input over the gloo control group and every rank runs
the model on it (SPMD). A dead worker breaks the next collective at once (gloo reports the closed
connection) or is seen by a watchdog thread; either way the engine raises ``EngineDeadError``.
Workers die with the driver (PR_SET_PDEATHSIG) and are joined or killed on shutdown.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback

import torch

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import destroy_distributed, get_free_port, init_distributed
from tpspec.worker.model_runner import ModelRunner
from tpspec.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A TP worker died or a collective failed: the engine cannot continue."""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def _threads_per_rank(tp: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp)


def _worker_main(rank: int, config: EngineConfig, device_kind: str, init_method: str) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[tpspec worker {rank}] %(levelname)s %(message)s")
    tp = config.parallel.tensor_parallel_size
    torch.set_num_threads(_threads_per_rank(tp))
    try:
        device = _device(device_kind, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_distributed(rank, tp, init_method, config.parallel.backend, device, config.parallel.worker_timeout_s)
        runner = ModelRunner(config, device)
        runner.load_model()
        while True:
            kind, arg = comm.broadcast_object(None, "rpc")
            if kind == "shutdown":
                break
            if kind == "execute":
                runner.execute(arg)
            elif kind == "ready":
                pass
    except Exception:  # the driver sees the closed connection; log why this rank went away
        logging.getLogger(__name__).error("worker %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    destroy_distributed()


class Executor:
    def __init__(self, config: EngineConfig, device_kind: str):
        self.config = config
        self.tp = config.parallel.tensor_parallel_size
        self.workers: list[subprocess.Popen] = []
        self.dead: str | None = None
        self._closed = False
        torch.set_num_threads(_threads_per_rank(self.tp))
        comm.reset_comm_stats()  # counters are per process; start this engine's from zero
        init_method = f"tcp://127.0.0.1:{get_free_port()}"
        for rank in range(1, self.tp):
            p = subprocess.Popen([sys.executable, "-m", "tpspec.distributed.executor"], stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps((rank, config, device_kind, init_method)))
            p.stdin.close()
            self.workers.append(p)
        try:
            device = _device(device_kind, 0)
            init_distributed(0, self.tp, init_method, config.parallel.backend, device, config.parallel.worker_timeout_s)
            self.runner = ModelRunner(config, device)
            self.runner.load_model()
            self._rpc("ready", None)
        except Exception:
            self.shutdown()
            raise
        for rank, p in enumerate(self.workers, start=1):
            threading.Thread(target=self._watch, args=(rank, p), name=f"tpspec-watchdog-{rank}", daemon=True).start()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self._closed and not self.dead:
            self.dead = f"TP worker rank {rank} (pid {p.pid}) died with exit code {code}"
            logger.error(self.dead)

    def _rpc(self, kind: str, arg) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        try:
            comm.broadcast_object((kind, arg), "rpc")
        except RuntimeError as e:
            self.dead = self.dead or f"TP collective failed: {e}"
            raise EngineDeadError(self.dead) from e

    def execute(self, step: StepInput) -> StepOutput:
        self._rpc("execute", step)
        try:
            return self.runner.execute(step)
        except Exception as e:
            if not self.workers:
                raise
            # The ranks are out of step now (or a peer is gone): nothing more can run.
            self.dead = self.dead or f"TP step failed: {type(e).__name__}: {e}"
            raise EngineDeadError(self.dead) from e

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.workers and not self.dead:
            try:
                comm.broadcast_object(("shutdown", None), "rpc")
            except RuntimeError:
                pass
        for p in self.workers:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        destroy_distributed()


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
