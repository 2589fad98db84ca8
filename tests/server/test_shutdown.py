"""Graceful shutdown and deadlines, in-process against a fake engine whose requests run until
released, so every ordering is deterministic: SIGTERM stops new connections at once, in-flight
requests finish within the grace period or are then aborted (503, or an error event on a stream)
with their engine requests freed; a request past its deadline ends with 504 and is aborted; a body
that arrives too slowly is a 408. The real signal wiring runs in ``test_faults``."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from tpspec.engine.async_engine import AsyncEngine  # noqa: E402
from tpspec.server.api import build_app  # noqa: E402
from tpspec.server.lifecycle import GracefulServer, bind  # noqa: E402
from tpspec.server.limits import ServerLimits  # noqa: E402
from tpspec.tokenizer import Tokenizer  # noqa: E402

from .fakes import FakeEngine  # noqa: E402
from .utils import ServerThread, assert_openai_error, metrics, open_stream, request, wait_until  # noqa: E402

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)

COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 5}
CHAT_STREAM = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}


class GracefulThread:
    """``GracefulServer`` in a background thread on a free loopback port."""

    def __init__(self, app, engine: AsyncEngine, grace_s: float) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        self.server = GracefulServer(config, engine, grace_s)
        self.sock = bind(config)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "GracefulThread":
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake(tiny_llama):
    fake = FakeEngine(tokenizer=Tokenizer.from_pretrained(tiny_llama), max_model_len=64, step_s=0.005)
    engine = AsyncEngine(lambda: fake)
    yield fake, engine
    engine.shutdown()


def _in_background(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    thread.start()
    return thread, box


def _events(resp) -> list[bytes]:
    return [line[6:].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_listener_has_tcp_nodelay():
    sock = bind(uvicorn.Config(None, host="127.0.0.1", port=0))
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_sigterm_lets_in_flight_requests_finish(fake):
    fake_engine, engine = fake
    fake_engine.hold.set()
    with GracefulThread(build_app(engine, ["fake"]), engine, grace_s=30) as srv:
        thread, box = _in_background(lambda: request("POST", srv.url + "/v1/completions", COMPLETION))
        conn, resp = open_stream(srv.url + "/v1/chat/completions", CHAT_STREAM)
        assert resp.status == 200
        assert wait_until(lambda: len(fake_engine.requests) == 2)
        srv.server.handle_exit(signal.SIGTERM, None)
        assert wait_until(lambda: _refused(srv.port), timeout=5)  # no new connections
        assert srv.thread.is_alive() and engine.num_requests == 2  # ... but the two in flight go on
        fake_engine.hold.clear()
        events = _events(resp)
        conn.close()
        thread.join(10)
        srv.thread.join(15)
        assert not srv.thread.is_alive() and srv.server.exit_code == 0
    assert events[-1] == b"[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    status, body, _ = box["result"]
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "t10 t11 t12 t13 t14 "
    assert fake_engine.aborted == []


def test_sigterm_aborts_what_outlives_the_grace_period(fake):
    fake_engine, engine = fake
    fake_engine.hold.set()  # never released: both requests outlive the grace period
    app = build_app(engine, ["fake"])
    with GracefulThread(app, engine, grace_s=0.5) as srv:
        thread, box = _in_background(lambda: request("POST", srv.url + "/v1/completions", COMPLETION))
        conn, resp = open_stream(srv.url + "/v1/chat/completions", CHAT_STREAM)
        assert wait_until(lambda: len(fake_engine.requests) == 2)
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        assert app.state.server.draining or wait_until(lambda: app.state.server.draining)
        events = _events(resp)
        conn.close()
        thread.join(10)
        srv.thread.join(15)
        elapsed = time.monotonic() - start
        assert not srv.thread.is_alive() and srv.server.exit_code == 0
    assert 0.5 <= elapsed < 5
    assert events[-1] == b"[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    err = assert_openai_error(*box["result"][:2], 503)
    assert err["code"] == "server_shutting_down"
    assert wait_until(lambda: len(fake_engine.aborted) == 2) and fake_engine.requests == {}


def test_draining_server_refuses_new_requests_and_reports_unhealthy(fake):
    _, engine = fake
    app = build_app(engine, ["fake"])
    with ServerThread(app) as srv:
        app.state.server.draining = True
        status, body, headers = request("POST", srv.url + "/v1/completions", COMPLETION)
        assert assert_openai_error(status, body, 503)["code"] == "server_shutting_down"
        assert headers["retry-after"] == "1"
        assert assert_openai_error(*request("GET", srv.url + "/health")[:2], 503)["code"] == "server_shutting_down"


def test_request_timeout_aborts_the_request(fake):
    fake_engine, engine = fake
    fake_engine.hold.set()
    with ServerThread(build_app(engine, ["fake"], limits=ServerLimits(request_timeout_s=0.3))) as srv:
        thread, box = _in_background(lambda: request("POST", srv.url + "/v1/completions", COMPLETION))
        conn, resp = open_stream(srv.url + "/v1/chat/completions", CHAT_STREAM)
        events = _events(resp)
        conn.close()
        thread.join(10)
        assert events[-1] == b"[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        err = assert_openai_error(*box["result"][:2], 504)
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"]
        assert wait_until(lambda: len(fake_engine.aborted) == 2) and fake_engine.requests == {}
        kinds = metrics(srv.url)
        assert kinds[("tpspec:request_errors_total", (("kind", "request_timeout"),))] == 2
        # A body that never fully arrives: 408 once the deadline passes, not a connection held forever.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
