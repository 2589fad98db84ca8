"""When the engine dies, in-flight requests get an error (streamed or not), /health turns 503,
new requests get 503, and the server itself keeps answering. Uses a fake engine told to die."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tpspec.engine.async_engine import AsyncEngine  # noqa: E402
from tpspec.server.api import build_app  # noqa: E402
from tpspec.tokenizer import Tokenizer  # noqa: E402

from .fakes import FakeEngine  # noqa: E402
from .utils import ServerThread, assert_openai_error, metrics, open_stream, request, wait_until  # noqa: E402


def test_engine_death(tiny_llama):
    fake = FakeEngine(tokenizer=Tokenizer.from_pretrained(tiny_llama), max_model_len=64, step_s=0.01)
    engine = AsyncEngine(lambda: fake)
    try:
        with ServerThread(build_app(engine, ["fake"])) as srv:
            assert request("GET", srv.url + "/health")[0] == 200
            body = {"model": "fake", "prompt": "hello", "max_tokens": 30}
            ok = request("POST", srv.url + "/v1/completions", {**body, "max_tokens": 3})
            assert ok[0] == 200 and json.loads(ok[1])["choices"][0]["text"] == "t10 t11 t12 "

            waiting = {}
            thread = threading.Thread(target=lambda: waiting.update(r=request("POST", srv.url + "/v1/completions", body)))
            thread.start()
            conn, resp = open_stream(srv.url + "/v1/chat/completions", {
                "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True})
            assert resp.status == 200 and resp.readline().startswith(b"data: ")  # the role chunk
            assert wait_until(lambda: len(fake.requests) == 2)
            fake.die.set()

            events = [line[6:].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]
            conn.close()
            assert events[-1] == b"[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_dead"
            thread.join(30)
            err = assert_openai_error(*waiting["r"][:2], 503)
            assert err["code"] == "engine_dead"

            err = assert_openai_error(*request("GET", srv.url + "/health")[:2], 503)
            assert err["code"] == "engine_dead"
            assert_openai_error(*request("POST", srv.url + "/v1/completions", body)[:2], 503)
            # Still serving what does not need the engine, and bad requests are still 4xx.
            assert request("GET", srv.url + "/v1/models")[0] == 200
            assert metrics(srv.url)[("tpspec:request_success_total", (("finished_reason", "length"),))] == 1
            assert_openai_error(*request("POST", srv.url + "/v1/completions", "{oops")[:2], 400)
    finally:
        engine.shutdown()
    assert fake.shut_down
