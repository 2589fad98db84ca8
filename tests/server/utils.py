"""Helpers for the server tests: an in-process uvicorn on a free loopback port (bare, or in front
of a real engine), the ``openai`` client, raw HTTP, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families


@contextlib.contextmanager
def serving(model_names: list[str], **engine_args):
    """A real engine (``AsyncEngine.from_args(**engine_args)``) behind the API on a ``ServerThread``,
    which holds it as ``.engine``; the engine is shut down afterwards."""
    from tpspec.engine.async_engine import AsyncEngine
    from tpspec.server.api import build_app

    engine = AsyncEngine.from_args(**engine_args)
    try:
        with ServerThread(build_app(engine, model_names)) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()


def openai_client(server):
    """The official client against ``server``, no retries."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_stats(server) -> dict:
    """The served engine's ``get_stats()``, taken between its steps."""
    return asyncio.run(server.engine.get_stats())


class ServerThread:
    """Serve ``app`` with uvicorn in a background thread, on a socket bound to a free port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ServerProcess:
    """``python -m tpspec serve ... --port 0``; the port is read from its 'ready' log line."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpspec", "serve", *args, "--port", "0", "--disable-uvicorn-access-log"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
        self.port = None

    def wait_ready(self, timeout: float = 60) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{open(self.log_path).read()}")
            if self.port is None:
                m = re.search(r"server ready: http://127\.0\.0\.1:(\d+)", open(self.log_path).read())
                if m:
                    self.port = int(m.group(1))
            if self.port is not None:
                try:
                    if request("GET", self.url + "/health")[0] == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout} s:\n{open(self.log_path).read()}")

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def request(method: str, url: str, body: bytes | str | dict | None = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, bytes, dict]:
    """(status, body, headers) of one raw HTTP request."""
    m = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, m.group(3), body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def open_stream(url: str, body: dict, headers: dict | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a request and return the live connection and response (headers read, body not)."""
    m = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=60)
    conn.request("POST", m.group(3), body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def assert_openai_error(status: int, body: bytes, expected_status: int) -> dict:
    """An OpenAI-shaped error body with no internals in it; returns the inner error."""
    assert status == expected_status, (status, body)
    data = json.loads(body)
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    for leak in ("Traceback", ".py", "/work", "site-packages", "File \""):
        assert leak not in err["message"], err["message"]
    return err


def metrics(url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from /metrics."""
    status, body, hdrs = request("GET", url + "/metrics", headers=headers)
    assert status == 200, body
    assert hdrs.get("content-type", "").startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_until(predicate, timeout: float = 20, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
