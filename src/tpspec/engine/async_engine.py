"""An asyncio front for ``LLMEngine``: one background thread owns the engine and steps it.

The engine is not thread-safe, so every engine call, creation included, happens on one
long-lived thread. Callers on any event loop hand requests, aborts and stats queries to that
thread through a thread-safe queue; the thread applies them between steps and feeds each
request's outputs into that request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. With
nothing to run, the thread blocks on the queue (no spinning).

If a step fails (``EngineDeadError`` from a dead TP worker, or anything else: the engine's state
can no longer be trusted), every in-flight request gets the error, new requests are refused with
it and ``is_healthy`` turns False. A TP worker that dies while the engine is idle wakes the
thread (``LLMEngine.on_worker_death``) and ends the engine the same way, with no request needed;
the requests in flight get the error at once, from the watchdog, even when the engine thread is
itself stuck in a collective with a node that vanished without closing its connections.

The queue is bounded: with ``max_waiting_requests`` set, a request that would make more than
``max_num_seqs + max_waiting_requests`` requests in flight (running or waiting) is refused with
``EngineOverloadedError`` at once, before it costs the engine anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tpspec.executor.executor import EngineDeadError
from tpspec.engine.llm_engine import LLMEngine
from tpspec.engine.outputs import RequestOutput
from tpspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The engine holds as many requests as it may queue; retry later."""


# How long shutdown waits for a dead engine's thread.
DEAD_ENGINE_JOIN_S = 2.0
# How long the loop waits for new work after a step that scheduled nothing (e.g. every waiting
# request is blocked on KV blocks held by nobody that is running yet): a short nap, not a spin.
_IDLE_NAP_S = 0.005


class _Stream:
    """The consumer side of one request: its event loop and asyncio queue."""

    __slots__ = ("loop", "queue", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the consumer's loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the loop was closed: nobody will read this request any more
            return False


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished one.

    Leaving it early (``break``, an exception, task cancellation, ``aclose()``) aborts the
    request, so its KV blocks are freed.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled (client gone) while waiting: free the request
            await self.aclose()
            raise
        if isinstance(item, BaseException):  # engine death, or ``fail``: free the request if it still runs
            self._finish(abort=True)
            raise item
        if item.finished:
            self._finish(abort=False)
        return item

    def _finish(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._engine._drop_stream(self.request_id, self._stream, abort=abort)

    def close(self) -> None:
        """Stop listening; aborts the request unless it already finished."""
        self._finish(abort=True)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised to its consumer, which aborts the request), e.g. at
        a deadline. Call it on the consumer's event loop."""
        if not self._done:
            self._stream.queue.put_nowait(error)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without being read to the end or closed: do not leak the request. No lock here
        # (a finalizer may run on a thread that holds it); SimpleQueue.put is safe in finalizers.
        if not getattr(self, "_done", True):
            self._engine._commands.put(("abort", self.request_id, self._stream))


class AsyncEngine:
    """Owns an ``LLMEngine`` on a background thread; ``generate`` streams outputs to asyncio code.

    ``AsyncEngine.from_args(**LLMEngine.from_args kwargs)`` creates and starts one; the
    constructor takes any zero-argument factory returning an engine-like object (tests use fakes).
    """

    def __init__(
        self, engine_factory: Callable[[], LLMEngine], start: bool = True, max_waiting_requests: int | None = None
    ) -> None:
        if max_waiting_requests is not None and (
            isinstance(max_waiting_requests, bool) or not isinstance(max_waiting_requests, int) or max_waiting_requests < 0
        ):
            raise ValueError(f"max_waiting_requests must be an integer >= 0 or None, got {max_waiting_requests!r}")
        self._factory = engine_factory
        self._max_waiting = max_waiting_requests
        self.max_requests: int | None = None  # running + waiting; set once the engine exists
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams, _dead_error and _closed against the engine thread
        self._streams: dict[str, _Stream] = {}
        self._dead_error: BaseException | None = None
        self._closed = False
        self._ready = threading.Event()
        self._ended = threading.Event()  # the engine is dead or its thread has stopped
        self._start_error: BaseException | None = None
        self._last_stats: dict[str, Any] = {}
        self._ids = itertools.count()
        self.engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="tpspec-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def from_args(cls, max_waiting_requests: int | None = None, **engine_args: Any) -> "AsyncEngine":
        return cls(lambda: LLMEngine.from_args(**engine_args), max_waiting_requests=max_waiting_requests)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and wait until the engine is built; re-raises its build error."""
        if self._thread.is_alive() or self._ready.is_set():
            return
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        if self._max_waiting is not None:
            self.max_requests = self.engine.config.scheduler.max_num_seqs + self._max_waiting

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (in-flight requests get an error) and shut the engine down. Idempotent. A
        dead engine's thread gets at most ``DEAD_ENGINE_JOIN_S``: one stuck in a collective with a
        lost node ends with the process."""
        if self._dead_error is not None:
            timeout = min(timeout, DEAD_ENGINE_JOIN_S)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            alive = self._thread.is_alive()
            if alive:
                self._commands.put(("shutdown",))
        if alive and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s%s", timeout,
                               " (a step waiting on a lost node?); it ends with the process" if self._dead_error else "")

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread has stopped (engine dead or shut down, workers gone)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Wait until the engine is dead or its thread has stopped (``join`` waits for the thread alone)."""
        return self._ended.wait(timeout)

    @property
    def num_requests(self) -> int:
        """Requests in flight: added and not yet finished, aborted or failed."""
        with self._lock:
            return len(self._streams)

    @property
    def is_healthy(self) -> bool:
        return self._dead_error is None and not self._closed and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine cannot serve requests."""
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # Read-only facts about the engine (set before start() returns, never changed afterwards).
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.arch.vocab_size

    # ---- requests -----------------------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        with self._lock:
            self.check_health()
            self._commands.put(command)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        after: str | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it (``after``: ``LLMEngine.add_request``'s).

        Bad input raises ``ValueError`` (from ``LLMEngine.add_request``); a dead engine raises
        ``EngineDeadError``; a full queue raises ``EngineOverloadedError``. Iterate the returned
        stream for the outputs.
        """
        loop = asyncio.get_running_loop()
        if params is not None and params.structured_outputs is not None and self.engine is not None:
            # Compile the grammar here, off the engine loop (other requests keep decoding while it
            # compiles); the engine's own check is then a cache hit. A bad one raises GrammarError.
            await asyncio.to_thread(self.engine.check_structured_outputs, params)
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = _Stream(loop)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self.max_requests is not None and len(self._streams) >= self.max_requests:
                raise EngineOverloadedError(
                    f"the engine holds {len(self._streams)} requests, its limit (max_num_seqs + max_waiting_requests)"
                )
            self._streams[request_id] = stream
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(("add", request_id, prompt, params, after, accepted))
            await asyncio.wrap_future(accepted)
        except BaseException:
            # Rejected by the engine (nothing to undo), dead, or cancelled while waiting (if the
            # add still lands, the abort queued behind it removes it again).
            rejected = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            self._drop_stream(request_id, stream, abort=not rejected)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (incremental ``new_text``/``new_token_ids``).

        Stopping the iteration early aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request and free its KV blocks; its consumer gets a last output with
        finish_reason "abort". No-op if the request is unknown or already finished."""
        with self._lock:
            if self._dead_error is None and not self._closed:
                self._commands.put(("abort", request_id, None))

    def abort_all(self, error: BaseException) -> int:
        """End every in-flight request: its consumer gets ``error`` and the engine aborts it (its KV
        blocks are freed). Returns how many there were. The engine keeps serving new requests."""
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id, stream in streams.items():
                if not stream.finished:
                    stream.put(error)
                if self._dead_error is None and not self._closed:
                    self._commands.put(("abort", request_id, None))
        return len(streams)

    def _drop_stream(self, request_id: str, stream: _Stream, abort: bool) -> None:
        """The consumer of ``stream`` stopped listening; abort the request if it still runs."""
        with self._lock:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if abort and not stream.finished and self._dead_error is None and not self._closed:
                self._commands.put(("abort", request_id, stream))

    async def get_stats(self) -> dict[str, Any]:
        """The engine's ``get_stats()``, taken between steps; the last snapshot if it is dead."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(("stats", result))
        except EngineDeadError:
            return dict(self._last_stats)
        try:
            return await asyncio.wrap_future(result)
        except EngineDeadError:
            return dict(self._last_stats)

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._start_error = e
            self._ready.set()
            self._ended.set()
            return
        self._ready.set()
        engine = self.engine
        try:
            engine.on_worker_death(self._on_worker_death)
            self._loop(engine)
        except BaseException as e:  # noqa: BLE001 - any step failure leaves the engine unusable
            if isinstance(e, EngineDeadError):
                logger.error("engine died: %s", e)
                error: BaseException = e
            else:
                logger.exception("engine step failed; the engine is now unusable")
                error = EngineDeadError(f"engine step failed: {type(e).__name__}: {e}")
            self._fail_everything(error)
        finally:
            with self._lock:
                self._closed = True
            self._fail_everything(EngineDeadError("the engine is shut down"), mark_dead=False)
            try:
                engine.shutdown()
                logger.info("engine shut down")
            except Exception:  # noqa: BLE001
                logger.exception("engine shutdown failed")
            self._ended.set()

    def _on_worker_death(self, reason: str) -> None:
        """From the executor's watchdog: answer the requests in flight now, then wake the engine
        thread (if it is idle: a busy one sees the failed step itself)."""
        self._fail_everything(EngineDeadError(reason))
        self._commands.put(("worker-died", reason))

    def _loop(self, engine: LLMEngine) -> None:
        idle_nap = False
        while True:
            busy = engine.has_unfinished_requests()
            try:
                if not busy:
                    first = self._commands.get()  # idle: sleep until there is work
                elif idle_nap:
                    first = self._commands.get(timeout=_IDLE_NAP_S)
                else:
                    first = self._commands.get_nowait()
            except queue.Empty:
                first = None
            command = first
            while command is not None:
                if not self._apply(engine, command):
                    return
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if not engine.has_unfinished_requests():
                idle_nap = False
                continue
            steps_before = engine.stats.get("num_steps") if isinstance(getattr(engine, "stats", None), dict) else None
            outputs = engine.step()
            self._dispatch(outputs)
            idle_nap = not outputs and steps_before is not None and engine.stats.get("num_steps") == steps_before

    def _apply(self, engine: LLMEngine, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, after, accepted = command
            if not accepted.set_running_or_notify_cancel():  # the caller gave up before we got here
                return True
            try:
                engine.add_request(prompt, params, request_id, after)
            except Exception as e:  # noqa: BLE001 - bad input goes back to the caller
                accepted.set_exception(e)
                with self._lock:
                    self._streams.pop(request_id, None)
            else:
                accepted.set_result(request_id)
        elif kind == "abort":
            _, request_id, stream = command
            if stream is not None:  # the consumer is gone: nobody to tell
                with self._lock:
                    if self._streams.get(request_id) is stream:
                        del self._streams[request_id]
            out = engine.abort_request(request_id)
            if out is not None:
                self._dispatch([out])
        elif kind == "stats":
            result = command[1]
            stats = engine.get_stats()
            self._last_stats = stats
            if result.set_running_or_notify_cancel():
                result.set_result(stats)
        elif kind == "worker-died":
            raise EngineDeadError(command[1])
        elif kind == "shutdown":
            return False
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        gone = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    stream.finished = True
                if not stream.put(out) and not out.finished:
                    gone.append(out.request_id)
        for request_id in gone:
            self.abort(request_id)

    def _fail_everything(self, error: BaseException, mark_dead: bool = True) -> None:
        """Hand ``error`` to every in-flight request and pending command; refuse new ones."""
        with self._lock:
            if mark_dead and self._dead_error is None:
                self._dead_error = error
                self._ended.set()
            streams, self._streams = self._streams, {}
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for stream in streams.values():
            if not stream.finished:
                stream.put(error)
        for command in pending:
            future = command[-1] if command[0] in ("add", "stats") else None
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
