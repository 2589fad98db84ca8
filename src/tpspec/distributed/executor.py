"""The driver (rank 0, in the engine's process) plus tp−1 worker processes.

Workers are fresh interpreters (``python -m tpspec.distributed.executor``) that read their
arguments from stdin, so they never re-import the user's main module (a script without an
``if __name__ == "__main__"`` guard works).

Each step the driver broadcasts the step input over the gloo control group and every rank runs
the model on it (SPMD). A dead worker breaks the next collective at once (gloo reports the closed
connection) or is seen by a watchdog thread; either way the engine raises ``EngineDeadError``. The
watchdog also tells the ``on_death`` listeners at once, so an idle engine (an ``AsyncEngine``
waiting for requests) ends without waiting for the next step. A
worker that exits while the TP group forms fails the start at once. Workers die with the driver
(PR_SET_PDEATHSIG) and are joined or killed on shutdown, which also runs at interpreter exit.

Between steps the workers wait for the driver's next message in a gloo broadcast, which gives
up after ``worker_timeout_s``; so that an idle engine (a server without requests) keeps its
workers, the driver sends a keep-alive message whenever nothing has been sent for
``KEEPALIVE_FRACTION`` of that time.

The TP group and the communication counters are per process, so a process holds at most one live
executor with tensor_parallel_size > 1 and no other executor beside it.
"""

from __future__ import annotations

import atexit
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
import weakref
from collections.abc import Callable

import torch

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import destroy_distributed, get_free_port, get_state, init_distributed
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
    """Intra-op threads per rank: ``OMP_NUM_THREADS`` when set (e.g. 1 beside a busy HTTP thread),
    else the CPUs shared out among the ranks."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, (os.cpu_count() or 1) // tp)


def _worker_main(
    rank: int, config: EngineConfig, device_kind: str, init_method: str, driver_pid: int, ready_fd: int
) -> None:
    _die_with_parent()
    if os.getppid() != driver_pid:  # the driver died before the death signal was armed
        os._exit(1)
    # Ctrl-C in a terminal reaches the whole process group. It is the driver's to handle (it shuts
    # the workers down, or kills them when the interrupt cut a step short); a worker quitting on
    # its own would leave mid-collective and race the driver's handling with a dead-worker error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[tpspec worker {rank}] %(levelname)s %(message)s")
    tp = config.parallel.tensor_parallel_size
    torch.set_num_threads(_threads_per_rank(tp))
    try:
        device = _device(device_kind, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.write(ready_fd, b".")  # about to join the TP group (see Executor._wait_for_workers)
        os.close(ready_fd)
        init_distributed(rank, tp, init_method, config.parallel.backend, device, config.parallel.worker_timeout_s)
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


_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    # Before interpreter teardown, while the watchdog threads still run and torch is whole.
    for executor in list(_LIVE):
        executor.shutdown()


# Of worker_timeout_s: the longest the driver stays silent before a keep-alive message.
KEEPALIVE_FRACTION = 0.25


class Executor:
    def __init__(self, config: EngineConfig, device_kind: str):
        self.config = config
        self.tp = config.parallel.tensor_parallel_size
        self.workers: list[subprocess.Popen] = []
        self.dead: str | None = None
        self._last_rpc = time.monotonic()
        self._stopping = threading.Event()  # set by shutdown: the keep-alive thread ends
        self._death_listeners: list[Callable[[str], None]] = []
        self._death_lock = threading.Lock()  # a listener is told exactly once, however the race goes
        self._closed = False
        self._step_lock = threading.Lock()  # held while the ranks run a step (shutdown may come from another thread)
        if device_kind == "cuda" and torch.cuda.device_count() < self.tp:
            raise ValueError(
                f"tensor_parallel_size={self.tp} needs one CUDA device per rank; "
                f"{torch.cuda.device_count()} visible"
            )
        live = [e for e in _LIVE if not e._closed]
        if live and (self.tp > 1 or any(e.tp > 1 for e in live)):
            # The TP group is process-global: a second engine would run its collectives on it.
            raise RuntimeError(
                f"cannot start an engine with tensor_parallel_size={self.tp} while this process runs one "
                f"with tensor_parallel_size={live[0].tp}: an engine with tensor_parallel_size > 1 must be "
                "the only one in its process; shut the other down first"
            )
        _LIVE.add(self)
        torch.set_num_threads(_threads_per_rank(self.tp))
        comm.reset_comm_stats()  # counters are per process; start this engine's from zero
        init_method = f"tcp://127.0.0.1:{get_free_port()}"
        try:
            ready_r, ready_w = os.pipe()
            try:
                try:
                    for rank in range(1, self.tp):
                        p = subprocess.Popen(
                            [sys.executable, "-m", "tpspec.distributed.executor"],
                            stdin=subprocess.PIPE,
                            pass_fds=(ready_w,),
                        )
                        self.workers.append(p)
                        p.stdin.write(pickle.dumps((rank, config, device_kind, init_method, os.getpid(), ready_w)))
                        p.stdin.close()
                finally:
                    os.close(ready_w)  # the workers hold their own copies
                self._wait_for_workers(ready_r)
            finally:
                os.close(ready_r)
            device = _device(device_kind, 0)
            init_distributed(0, self.tp, init_method, config.parallel.backend, device, config.parallel.worker_timeout_s)
            self.runner = ModelRunner(config, device)
            self.runner.load_model()
            self._rpc("ready", None)
        except BaseException:  # Ctrl-C too: never leave workers waiting in the rendezvous
            self.shutdown()
            raise
        for rank, p in enumerate(self.workers, start=1):
            threading.Thread(target=self._watch, args=(rank, p), name=f"tpspec-watchdog-{rank}", daemon=True).start()
        if self.workers:
            threading.Thread(target=self._keep_alive, name="tpspec-keepalive", daemon=True).start()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _wait_for_workers(self, ready_fd: int) -> None:
        """Wait until every worker is about to join the TP group (it writes a byte to ``ready_fd``);
        one that exits first (bad device, import error, killed) fails the start at once. Rank 0
        only joins after that: an init_process_group left waiting for a dead rank would break every
        later one in this process."""
        missing = len(self.workers)
        deadline = time.monotonic() + self.config.parallel.worker_timeout_s
        while missing:
            if select.select([ready_fd], [], [], 0.05)[0]:
                data = os.read(ready_fd, missing)
                missing -= len(data)
                if not data:  # every worker closed its end: some exited without reporting
                    time.sleep(0.01)
            for rank, p in enumerate(self.workers, start=1):
                if p.poll() is not None:
                    raise EngineDeadError(
                        f"TP worker rank {rank} (pid {p.pid}) exited with exit code {p.returncode} "
                        "before joining the TP group; see its log above"
                    )
            if missing and time.monotonic() > deadline:
                raise EngineDeadError(
                    f"TP workers did not start within worker_timeout_s={self.config.parallel.worker_timeout_s} s"
                )

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        if hasattr(os, "waitid"):
            # Wait without reaping: a thread blocked in p.wait() holds the Popen's lock, and at
            # interpreter exit (daemon threads frozen) it would keep shutdown's p.wait() from returning.
            try:
                info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            except ChildProcessError:  # already reaped by shutdown
                code = p.returncode
        else:
            code = p.wait()
        if not self._closed and not self.dead:
            self.dead = f"TP worker rank {rank} (pid {p.pid}) died with exit code {code}"
            logger.error(self.dead)
            shm = get_state().shm
            if shm is not None:  # a shared-memory collective waiting for it gives up now
                shm.abort_reason = self.dead
            with self._death_lock:
                listeners, self._death_listeners = self._death_listeners, []
            for callback in listeners:
                self._tell(callback, self.dead)

    def _keep_alive(self) -> None:
        """While the engine is idle, a "ready" message every ``KEEPALIVE_FRACTION ·
        worker_timeout_s``, so the workers' wait for the next message never times out. A step
        running (the step lock held) is a message already."""
        interval = KEEPALIVE_FRACTION * self.config.parallel.worker_timeout_s
        while not self._stopping.wait(interval / 4):
            if self.dead:
                return
            if time.monotonic() - self._last_rpc < interval or not self._step_lock.acquire(blocking=False):
                continue
            try:
                if self._stopping.is_set() or self.dead:
                    return
                self._rpc("ready", None)
            except BaseException:  # noqa: BLE001 - the engine is dead; its next call says why
                return
            finally:
                self._step_lock.release()

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once when a worker dies: from the watchdog thread as soon as it
        sees the death, or at once if one has already died."""
        with self._death_lock:
            if not self.dead:
                self._death_listeners.append(callback)
                return
        self._tell(callback, self.dead)

    @staticmethod
    def _tell(callback: Callable[[str], None], reason: str) -> None:
        try:
            callback(reason)
        except Exception:  # noqa: BLE001 - one listener's failure must not silence the others
            logger.exception("worker-death listener failed")

    def _rpc(self, kind: str, arg) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        self._last_rpc = time.monotonic()
        try:
            comm.broadcast_object((kind, arg), "rpc")
        except RuntimeError as e:
            self.dead = self.dead or f"TP collective failed: {e}"
            raise EngineDeadError(self.dead) from e
        except BaseException as e:  # e.g. Ctrl-C halfway through the broadcast
            self.dead = self.dead or f"TP broadcast interrupted: {type(e).__name__}"
            raise

    def execute(self, step: StepInput) -> StepOutput:
        return self._on_every_rank("execute", step, lambda: self.runner.execute(step))

    def call(self, method: str):
        """Run ``ModelRunner.<method>()`` on every rank (SPMD, e.g. a profile); returns rank 0's result."""
        return self._on_every_rank("call", method, getattr(self.runner, method))

    def _on_every_rank(self, kind: str, arg, run_here):
        with self._step_lock:
            self._rpc(kind, arg)
            try:
                return run_here()
            except BaseException as e:
                if not self.workers:
                    raise
                # The ranks are out of step now (or a peer is gone): nothing more can run.
                self.dead = self.dead or f"TP {kind} failed: {type(e).__name__}: {e}"
                if isinstance(e, Exception):
                    raise EngineDeadError(self.dead) from e
                raise  # KeyboardInterrupt, SystemExit: passed on; the engine is dead all the same

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        _LIVE.discard(self)
        graceful = bool(self.workers) and not self.dead
        # A step still running in another thread (e.g. at interpreter exit) would interleave with
        # the shutdown message: then the workers are killed instead.
        if graceful and self._step_lock.acquire(timeout=1):
            try:
                comm.broadcast_object(("shutdown", None), "rpc")
            except Exception:
                graceful = False
            finally:
                self._step_lock.release()
        else:
            graceful = False
        for p in self.workers:
            if graceful:
                try:
                    p.wait(timeout=5)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            p.kill()  # out of step with us (or stuck): it cannot stop by itself
            p.wait()
        destroy_distributed()


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
