"""``tpspec serve``: the engine and the app under uvicorn, a graceful drain on SIGTERM, and a stop
when the engine dies.

On SIGTERM (or a first Ctrl-C) the listening socket closes at once, idle connections close, a
request still arriving on an open connection gets 503 ``server_shutting_down`` with Retry-After,
and the requests in flight get ``grace_s`` seconds to finish; those left then end with a 503 (an
error event on a stream) and are aborted, which frees their KV blocks. The engine and its TP
workers are shut down after the last response, and ``tpspec serve`` exits with status 0.

When the engine dies (a TP worker killed, a failed step), every request in flight has already
been answered with 503 ``engine_dead``; the server then stops the same way, the surviving workers
are killed and reaped, and ``tpspec serve`` exits with status 1 (``EXIT_ENGINE_DEAD``), for a
supervisor to restart it. It never waits on a dead engine and leaves no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import threading
from typing import Any

import uvicorn

from tpspec.engine.async_engine import AsyncEngine
from tpspec.server.api import build_app
from tpspec.server.args import API_KEY_ENV, server_limits
from tpspec.server.protocol import APIError

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 1
# uvicorn's own backstop, past the grace period: tasks still running then are cancelled.
_UVICORN_EXTRA_S = 5.0


def check_grace_period(grace_s: float) -> None:
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s < float("inf"):
        raise ValueError(f"grace_s (--shutdown-grace-period) must be a number of seconds >= 0, got {grace_s!r}")


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` over an app from ``build_app``, draining as described above."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        check_grace_period(grace_s)
        config.timeout_graceful_shutdown = int(grace_s + _UVICORN_EXTRA_S)
        super().__init__(config)
        self.engine = engine
        self.grace_s = float(grace_s)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE_DEAD if self.engine.dead_error is not None else 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._watch_engine, name="tpspec-engine-watch", daemon=True).start()
        await super().serve(sockets)

    def _watch_engine(self) -> None:
        self.engine.wait_ended()
        if self.engine.dead_error is not None and not self.should_exit:
            logger.error("the engine died (%s): stopping the server", self.engine.dead_error)
            self.should_exit = True  # uvicorn's main loop polls it

    def handle_exit(self, sig: int, frame) -> None:
        draining = self.should_exit
        super().handle_exit(sig, frame)
        if not draining and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain, sig)

    def _drain(self, sig: int) -> None:
        self.config.app.state.server.draining = True
        logger.info("%s: accepting no new requests; %d in flight get %.3g s to finish",
                    signal.Signals(sig).name, self.engine.num_requests, self.grace_s)
        self._loop.call_later(self.grace_s, self._abort_the_rest)

    def _abort_the_rest(self) -> None:
        n = self.engine.abort_all(APIError("The server is shutting down.", 503, code="server_shutting_down"))
        if n:
            logger.warning("shutdown grace period over: aborted %d request(s) still in flight", n)


def bind(config: uvicorn.Config):
    """The listening socket, with TCP_NODELAY, which the connections it accepts inherit. asyncio
    sets it only on sockets created with proto=IPPROTO_TCP, and uvicorn's are not: without it, a
    response written in two pieces (headers, then body) or an SSE event waits for the client's
    delayed ACK, about 40 ms on every request of a kept-alive connection."""
    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(engine: AsyncEngine, config: uvicorn.Config, grace_s: float, description: str) -> int:
    """Bind, serve ``config.app`` until SIGTERM/SIGINT or engine death, return the exit status. The
    caller shuts the engine down afterwards."""
    server = GracefulServer(config, engine, grace_s)
    # What exists now (the model, its modules and tensors, the app) lives as long as the server:
    # frozen, a full garbage collection no longer walks it. Unfrozen, one took 128 ms mid-stream
    # (one stream of the default model with EAGLE-3), and the engine's step waited for it; frozen,
    # none took over 2 ms serving the same requests. vLLM's engine core freezes its heap too (freeze_gc_heap).
    gc.collect()
    gc.freeze()
    sock = bind(config)
    host, port = sock.getsockname()[:2]
    logger.info("tpspec server ready: http://%s:%d (%s)", host, port, description)
    # uvicorn re-raises the signal it stopped on to the handler it found: make SIGTERM's a no-op so
    # the caller still shuts the engine down and the exit status is ours.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return server.exit_code


# ---- `tpspec serve` -------------------------------------------------------------------------------
def run_server(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """Build the engine (on its own thread), then serve until SIGINT/SIGTERM or engine death;
    returns the exit status (``lifecycle``). With ``--headless``: run one of the other nodes of a
    multi-node engine instead (``executor.node_agent``)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice and differently: {args.model_tag!r} and --model {args.model!r}")
        engine_args["model"] = args.model_tag
    if args.headless:  # this node's configuration from the engine flags, checked as the head checks its own
        from tpspec.engine.engine_args import EngineArgs, resolve_device
        from tpspec.executor.node_agent import run_node

        node_args = EngineArgs(**engine_args)
        device_kind = resolve_device(node_args.device)
        return run_node(node_args.create_engine_config(device_kind), device_kind)
    if args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: tpspec runs no code from model folders")
    if args.gpu_memory_utilization is not None:
        logger.info("--gpu-memory-utilization is ignored: size the KV cache with --kv-cache-memory-gb or --num-kv-blocks")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    limits = server_limits(args)  # bad flag values fail before the engine is built
    check_grace_period(args.shutdown_grace_period)
    model = engine_args.get("model")
    if args.served_model_name:
        names = args.served_model_name
    elif model is not None:
        names = [model]
    else:
        from tpspec.default_model import DEFAULT_MODEL_FILE

        names = [DEFAULT_MODEL_FILE.split(".")[0]]

    engine = AsyncEngine.from_args(max_waiting_requests=args.max_waiting_requests, **engine_args)
    try:
        app = build_app(engine, names, api_key=api_key, model_path=model, limits=limits,
                        allowed_origins=args.allowed_origins)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                                server_header=False)
        description = f"model {names[0]}" + (", API key required" if api_key else "")
        return serve(engine, config, args.shutdown_grace_period, description)
    finally:
        engine.shutdown()
