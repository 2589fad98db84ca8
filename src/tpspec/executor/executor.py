"""The driver (rank 0, in the engine's process) plus the other TP ranks: worker processes on this
node (``local_workers``) and, for a multi-node engine, the ranks of the other nodes, each run by
its node agent (``node_agent``) and linked to the head (``node_link``).

Each step the driver broadcasts the step input over the gloo control group and every rank runs
the model on it (SPMD). A dead worker breaks the next collective at once (gloo reports the closed
connection) or is seen by a watchdog thread (a local worker's exit, a node's link closing or
reporting a dead rank); either way the engine raises ``EngineDeadError``. The watchdog also tells
the ``on_death`` listeners at once, so an idle engine (an ``AsyncEngine`` waiting for requests)
ends without waiting for the next step. A worker or node that fails while the TP group forms
fails the start at once. Local workers die with the driver's process (through its fork server,
``fork_server``), a node's workers with its agent, which exits when the head's link closes; all
are joined or killed on shutdown, which also runs at interpreter exit.

Between steps the workers wait for the driver's next message in a gloo broadcast, which gives
up after ``worker_timeout_s``; so that an idle engine (a server without requests) keeps its
workers, the driver sends a keep-alive message whenever nothing has been sent for
``KEEPALIVE_FRACTION`` of that time.

The TP group and the communication counters are per process, so a process holds at most one live
executor with tensor_parallel_size > 1 and no other executor beside it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.executor.fingerprint import config_fingerprint
from tpspec.executor.local_workers import (
    EngineDeadError,
    LocalWorkers,
    check_cuda_devices,
    rank_device,
    threads_per_rank,
)
from tpspec.executor.node_link import HeadLinks, rendezvous_method
from tpspec.distributed.parallel_state import destroy_distributed, get_free_port, get_state, init_distributed
from tpspec.worker.model_runner import ModelRunner
from tpspec.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "Executor"]


_LIVE: "weakref.WeakSet[Executor]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    # Before interpreter teardown, while the watchdog threads still run and torch is whole.
    for executor in list(_LIVE):
        executor.shutdown()


# How long a failed collective waits for a watchdog to say which rank or node is gone.
DEATH_REPORT_WAIT_S = 1.0
# Of worker_timeout_s: the longest the driver stays silent before a keep-alive message.
KEEPALIVE_FRACTION = 0.25


class Executor:
    def __init__(self, config: EngineConfig, device_kind: str):
        self.config = config
        parallel = config.parallel
        self.tp = parallel.tensor_parallel_size
        if parallel.node_rank != 0:
            raise ValueError(f"the engine runs on the head node (node_rank 0), got node_rank={parallel.node_rank}: "
                             "the other nodes run `tpspec serve --headless`")
        self.local: LocalWorkers | None = None  # this node's ranks but 0
        self.nodes: HeadLinks | None = None  # the other nodes (multi-node)
        self.dead: str | None = None
        self._last_rpc = time.monotonic()
        self._stopping = threading.Event()  # set by shutdown: the keep-alive thread ends
        self._death_listeners: list[Callable[[str], None]] = []
        self._death_lock = threading.Lock()  # a listener is told exactly once, however the race goes
        self._death_reported = threading.Event()  # a watchdog declared a rank or node dead
        self._closed = False
        self._started = False  # every rank has joined and loaded the model
        self._step_lock = threading.Lock()  # held while the ranks run a step (shutdown may come from another thread)
        check_cuda_devices(config, device_kind)
        live = [e for e in _LIVE if not e._closed]
        if live and (self.tp > 1 or any(e.tp > 1 for e in live)):
            # The TP group is process-global: a second engine would run its collectives on it.
            raise RuntimeError(
                f"cannot start an engine with tensor_parallel_size={self.tp} while this process runs one "
                f"with tensor_parallel_size={live[0].tp}: an engine with tensor_parallel_size > 1 must be "
                "the only one in its process; shut the other down first"
            )
        _LIVE.add(self)
        torch.set_num_threads(threads_per_rank(config))
        comm.reset_comm_stats()  # counters are per process; start this engine's from zero
        try:
            if parallel.nnodes > 1:
                self.nodes = HeadLinks(parallel, config_fingerprint(config, device_kind))
                self.nodes.admit()  # ValueError / NodeStartError: a node differs or is missing
                init_method = rendezvous_method(parallel)
            else:
                init_method = f"tcp://{parallel.master_addr}:{parallel.master_port or get_free_port()}"
            if self.tp > 1:
                self.local = LocalWorkers(config, device_kind, parallel.node_ranks()[1:], init_method)
                self.local.wait_until_joining(parallel.worker_timeout_s)
            if self.nodes is not None:
                self.nodes.wait_ready(self.local.check if self.local else lambda: None)
            device = rank_device(device_kind, config, 0)
            init_distributed(0, self.tp, init_method, parallel.backend, device, parallel.worker_timeout_s,
                             parallel.nnodes)
            self.runner = ModelRunner(config, device)
            self.runner.load_model()
            self._rpc("ready", None)
            self._started = True
        except BaseException:  # Ctrl-C too: never leave workers waiting in the rendezvous
            self.shutdown()
            raise
        if self.local is not None:
            self.local.watch(self._declare_dead)
        if self.nodes is not None:
            self.nodes.watch(self._declare_dead)
        if self.tp > 1:
            threading.Thread(target=self._keep_alive, name="tpspec-keepalive", daemon=True).start()

    @property
    def workers(self) -> list:
        """This node's worker processes (``fork_server.ForkedProcess``)."""
        return self.local.procs if self.local is not None else []

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _declare_dead(self, reason: str) -> None:
        """A rank died (a local worker exited, a node's link closed or reported one): fail fast."""
        if self._closed or self.dead:
            return
        self.dead = reason
        self._death_reported.set()
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

    def _reported_death(self) -> str | None:
        """After a failed collective: the watchdogs' reason (it names the rank or node that went
        away) if one reports within ``DEATH_REPORT_WAIT_S``, else None."""
        self._death_reported.wait(DEATH_REPORT_WAIT_S)
        return self.dead

    def _rpc(self, kind: str, arg) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        self._last_rpc = time.monotonic()
        try:
            comm.broadcast_object((kind, arg), "rpc")
        except RuntimeError as e:
            self.dead = self._reported_death() or f"TP collective failed: {e}"
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
                if self.tp == 1:
                    raise
                # The ranks are out of step now (or a peer is gone): nothing more can run.
                reported = self._reported_death() if isinstance(e, Exception) else self.dead
                self.dead = reported or f"TP {kind} failed: {type(e).__name__}: {e}"
                if isinstance(e, Exception):
                    raise EngineDeadError(self.dead) from e
                raise  # KeyboardInterrupt, SystemExit: passed on; the engine is dead all the same

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        _LIVE.discard(self)
        graceful = self.tp > 1 and self._started and not self.dead
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
        if self.local is not None:
            self.local.stop(graceful)
        if self.nodes is not None:  # after the local workers: the other nodes had the message too
            self.nodes.close(shutdown=graceful)
        # A step stuck in a collective with a node that vanished (no closed connection to fail it)
        # holds the step lock until worker_timeout_s: leave its group to the process's exit.
        if self._step_lock.acquire(timeout=1):
            try:
                destroy_distributed()
            finally:
                self._step_lock.release()
