"""Faults against `tpspec serve` processes at TP 2 (one worker process beside the server).

A TP worker killed mid-generation: every request in flight ends with 503 ``engine_dead`` (streams
with an error event, then ``[DONE]``), /health stops answering 200, the server exits with status 1
and no process is left behind; killed while the server is idle, the same with no request needed
(/health alone sees it). SIGTERM with a request in flight: the request runs to its end,
then the server exits 0 and its worker is gone. The API key comes from the environment here."""

from __future__ import annotations

import json
import os
import signal
import threading

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .utils import ServerProcess, assert_openai_error, metrics, open_stream, request, wait_until  # noqa: E402

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)

KEY = "env-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE_FLAGS = ["--tensor-parallel-size", "2", "--max-model-len", "512", "--num-kv-blocks", "160"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
LONG = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0}


def _start(tiny_llama, log_path, *extra: str, env: dict | None = None) -> tuple[ServerProcess, list[psutil.Process]]:
    proc = ServerProcess([tiny_llama, "--served-model-name", "tiny", *ENGINE_FLAGS, *extra], str(log_path),
                         env={**ONE_THREAD, **(env or {})})
    proc.wait_ready()
    # The server's child is its fork server (executor/fork_server.py); the workers are its children.
    workers = [c for c in psutil.Process(proc.proc.pid).children(recursive=True) if c.ppid() != proc.proc.pid]
    assert len(workers) == 1, workers  # TP 2: one worker process
    return proc, workers


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _first_event(resp) -> dict:
    while True:
        line = resp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            return json.loads(line[6:])


def _rest(resp) -> list[bytes]:
    return [line[6:].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]


def _assert_stopped_for_the_death(proc: ServerProcess, workers: list[psutil.Process]) -> None:
    """The server saw its worker die, stopped cleanly (not a crash) and left no worker behind."""
    assert not _alive(workers[0])
    log = open(proc.log_path).read()
    assert "died" in log and "stopping the server" in log and "engine shut down" in log
    assert "Traceback" not in log.split("stopping the server", 1)[1]  # a clean stop, not a crash


def _background(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    thread.start()
    return thread, box


def test_worker_killed_mid_generation(tiny_llama, tmp_path):
    proc, workers = _start(tiny_llama, tmp_path / "server.log")
    try:
        streams = [open_stream(proc.url + "/v1/completions", {**LONG, "stream": True}) for _ in range(2)]
        for _, resp in streams:
            assert resp.status == 200 and _first_event(resp)["choices"][0]["finish_reason"] is None
        waiting = [_background(lambda: request("POST", proc.url + "/v1/completions", LONG)) for _ in range(2)]
        assert wait_until(lambda: metrics(proc.url)[("tpspec:num_requests_running", ())] == 4)
        os.kill(workers[0].pid, signal.SIGKILL)

        for conn, resp in streams:
            events = _rest(resp)
            conn.close()
            assert events[-1] == b"[DONE]", events[-3:]
            assert json.loads(events[-2])["error"]["code"] == "engine_dead", events[-2]
        for thread, box in waiting:
            thread.join(30)
            assert assert_openai_error(*box["result"][:2], 503)["code"] == "engine_dead"
        try:  # unhealthy: a 503 while it stops, then nothing listening
            assert assert_openai_error(*request("GET", proc.url + "/health", timeout=10)[:2], 503)["code"] == "engine_dead"
        except ConnectionError:
            pass
        assert proc.proc.wait(30) == 1
    finally:
        proc.stop()
    _assert_stopped_for_the_death(proc, workers)


def test_worker_killed_while_idle(tiny_llama, tmp_path):
    """No request in flight and none sent after the death: /health alone must see it, and the
    server must exit 1 by itself, for a supervisor polling /health to restart it."""
    proc, workers = _start(tiny_llama, tmp_path / "server.log")
    try:
        assert request("POST", proc.url + "/v1/completions", {**LONG, "max_tokens": 2})[0] == 200
        os.kill(workers[0].pid, signal.SIGKILL)

        def unhealthy() -> bool:
            try:
                status, body, _ = request("GET", proc.url + "/health", timeout=10)
            except ConnectionError:  # already stopped listening
                return True
            assert status in (200, 503), (status, body)
            return status == 503 and json.loads(body)["error"]["code"] == "engine_dead"

        assert wait_until(unhealthy, timeout=10), "/health still answers 200 after the worker died"
        assert proc.proc.wait(15) == 1
    finally:
        proc.stop()
    _assert_stopped_for_the_death(proc, workers)


def test_sigterm_finishes_the_request_in_flight(tiny_llama, tmp_path):
    proc, workers = _start(tiny_llama, tmp_path / "server.log", "--shutdown-grace-period", "60",
                           env={"TPSPEC_API_KEY": KEY})
    try:
        assert assert_openai_error(*request("POST", proc.url + "/v1/completions", LONG)[:2], 401)["code"] == "invalid_api_key"
        body = {**LONG, "max_tokens": 120, "stream": True, "stream_options": {"include_usage": True}}
        conn, resp = open_stream(proc.url + "/v1/completions", body, headers=AUTH)
        assert resp.status == 200 and _first_event(resp)["choices"][0]["finish_reason"] is None
        proc.proc.send_signal(signal.SIGTERM)
        events = _rest(resp)
        conn.close()
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert not _alive(workers[0])
    log = open(proc.log_path).read()
    assert "SIGTERM: accepting no new requests; 1 in flight" in log and "engine shut down" in log
