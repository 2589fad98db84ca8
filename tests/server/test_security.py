"""Security defaults and request context, in-process against a fake engine (fast, no model).

Loopback bind and CORS off by default; the API key guards everything but /health, whatever the
length or prefix of a wrong key; CORS preflights, when CORS is on, need no key; every answer
carries an X-Request-Id (the client's if it is a plain token) and each request logs one JSON line;
an unexpected exception is a bare 500 with the traceback in the log only, counted as an
internal error; chat templates run sandboxed and message text is never template code; no module
on the request path runs a shell or evaluates text."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import tpspec  # noqa: E402
from tpspec.engine.async_engine import AsyncEngine  # noqa: E402
from tpspec.server.api import build_app  # noqa: E402
from tpspec.server.args import add_serve_args, server_limits  # noqa: E402
from tpspec.server.limits import ServerLimits  # noqa: E402
from tpspec.tokenizer import Tokenizer  # noqa: E402

from .fakes import FakeEngine  # noqa: E402
from .utils import ServerThread, assert_openai_error, metrics, request, wait_until  # noqa: E402

KEY = "k3y-Secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def engine(tiny_llama):
    engine = AsyncEngine(lambda: FakeEngine(tokenizer=Tokenizer.from_pretrained(tiny_llama), max_model_len=64))
    yield engine
    engine.shutdown()


def test_defaults_are_closed():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args([])
    assert args.host == "127.0.0.1" and args.api_key is None and args.allowed_origins is None
    assert args.max_waiting_requests >= 0 and server_limits(args) == ServerLimits()
    with pytest.raises(ValueError, match="max_stop_strings"):
        server_limits(p.parse_args(["--max-stop-strings", "-1"]))
    with pytest.raises(ValueError, match="request_timeout_s"):
        ServerLimits(request_timeout_s=0)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AsyncEngine(lambda: None, start=False, max_waiting_requests=-1)


def test_api_key_everywhere_but_health(engine):
    with ServerThread(build_app(engine, ["fake"], api_key=KEY)) as srv:
        for headers in ({}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}, {"Authorization": "Bearer "}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                                 ("GET", "/version"), ("GET", "/no-such-path")):
                status, body, hdrs = request(method, srv.url + path, COMPLETION if method == "POST" else None, headers)
                assert assert_openai_error(status, body, 401)["code"] == "invalid_api_key"
                assert KEY not in body.decode() and hdrs["x-request-id"]
        assert request("GET", srv.url + "/health")[0] == 200
        assert request("POST", srv.url + "/v1/completions", COMPLETION, AUTH)[0] == 200
        assert metrics(srv.url, AUTH)[("tpspec:request_errors_total", (("kind", "invalid_api_key"),))] == 30


def test_cors_off_by_default_and_on_when_asked(engine):
    with ServerThread(build_app(engine, ["fake"])) as srv:
        for method, headers in (("OPTIONS", PREFLIGHT), ("GET", {"Origin": ORIGIN})):
            _, _, hdrs = request(method, srv.url + "/v1/models", headers=headers)
            assert not any(h.startswith("access-control-") for h in hdrs), hdrs
    with ServerThread(build_app(engine, ["fake"], api_key=KEY, allowed_origins=[ORIGIN])) as srv:
        status, _, hdrs = request("OPTIONS", srv.url + "/v1/completions", headers=PREFLIGHT)  # no key needed
        assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
        _, _, hdrs = request("OPTIONS", srv.url + "/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in hdrs
        status, _, hdrs = request("GET", srv.url + "/v1/models", headers={**AUTH, "Origin": ORIGIN})
        assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in hdrs["access-control-expose-headers"].lower()


def test_request_ids_and_structured_logs(engine, caplog):
    with ServerThread(build_app(engine, ["fake"])) as srv, caplog.at_level(logging.INFO, "tpspec.server.requests"):
        _, body, hdrs = request("POST", srv.url + "/v1/completions", COMPLETION, {"X-Request-Id": "client-id.42"})
        assert hdrs["x-request-id"] == "client-id.42"
        completion_id = json.loads(body)["id"]
        for bad in ("has space", "x" * 200, "semi;colon"):
            _, _, hdrs = request("GET", srv.url + "/v1/models", headers={"X-Request-Id": bad})
            assert re.fullmatch(r"[0-9a-f]{32}", hdrs["x-request-id"])
        status, _, hdrs = request("POST", srv.url + "/v1/completions", {"prompt": 5})
        assert status == 400 and hdrs["x-request-id"]

        def logged():  # a line is written once the response has gone out
            return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tpspec.server.requests"]
        assert wait_until(lambda: len(logged()) == 5)
    lines = logged()
    first = next(line for line in lines if line["request_id"] == "client-id.42")
    assert first["status"] == 200 and first["path"] == "/v1/completions" and first["error"] is None
    assert first["completion_id"] == completion_id and first["prompt_tokens"] > 0
    assert first["completion_tokens"] == 2 and first["finish_reason"] == "length" and first["duration_ms"] >= 0
    assert lines[-1]["status"] == 400 and lines[-1]["error"] == "invalid_request"


def test_unexpected_exception_is_a_bare_500(engine, caplog, monkeypatch):
    app = build_app(engine, ["fake"])

    def broken():
        raise RuntimeError(f"secret internals at {tpspec.__file__}")

    monkeypatch.setattr(app.state.server, "models", broken)
    monkeypatch.setattr(app.state.server, "completion_logprobs", lambda *a: broken())
    with ServerThread(app) as srv, caplog.at_level(logging.ERROR, "tpspec.server"):
        status, body, hdrs = request("GET", srv.url + "/v1/models")
        err = assert_openai_error(status, body, 500)
        assert err["code"] == "internal_error" and "secret" not in body.decode() and hdrs["x-request-id"]
        # The same bug mid-stream: a clean end with an error event, not a cut connection.
        status, body, _ = request("POST", srv.url + "/v1/completions", {**COMPLETION, "stream": True, "logprobs": 1})
        events = [line[6:] for line in body.splitlines() if line.startswith(b"data: ")]
        assert status == 200 and events[-1] == b"[DONE]" and b"secret" not in body
        assert json.loads(events[-2])["error"]["code"] == "internal_error"
        assert metrics(srv.url)[("tpspec:request_errors_total", (("kind", "internal_error"),))] == 2
        assert request("POST", srv.url + "/v1/completions", COMPLETION)[0] == 200  # still serving
    assert sum("secret internals" in (r.exc_text or "") for r in caplog.records) == 2


def test_chat_templates_are_sandboxed(tiny_llama, tmp_path, engine):
    tok = Tokenizer.from_pretrained(tiny_llama)
    text = tok.apply_chat_template([{"role": "user", "content": "{{ 7 * 7 }}{% raw %}"}])
    assert "{{ 7 * 7 }}{% raw %}" in text and "49" not in text  # message text is data, not template code
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os }}",
                     "{% set m = messages %}{{ m.append(1) }}", "{{ range(10**9) | list | length }}"):
        config = json.loads((pathlib.Path(tiny_llama) / "tokenizer_config.json").read_text())
        folder = tmp_path / str(abs(hash(template)))
        folder.mkdir()
        (folder / "tokenizer.json").write_text((pathlib.Path(tiny_llama) / "tokenizer.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        with pytest.raises(ValueError, match="chat template failed to render"):
            Tokenizer.from_pretrained(str(folder)).apply_chat_template([{"role": "user", "content": "hi"}])
    # Through the server: a template failure is a 400 about the messages.
    engine.engine.tokenizer = Tokenizer.from_pretrained(str(folder))
    with ServerThread(build_app(engine, ["fake"])) as srv:
        status, body, _ = request("POST", srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert assert_openai_error(status, body, 400)["param"] == "messages"


def test_no_shell_or_eval_on_the_request_path():
    root = pathlib.Path(tpspec.__file__).parent
    files = [*sorted((root / "server").glob("*.py")), root / "tokenizer.py", root / "engine" / "async_engine.py",
             root / "engine" / "llm_engine.py", root / "engine" / "detokenizer.py", root / "sampling_params.py"]
    pattern = re.compile(r"(?<![.\w])(eval|exec|compile|__import__)\(|\bos\.(system|popen|exec\w*)\(|\bsubprocess\b|shell=True"
                         r"|\bpickle\.loads?\(|\bjinja2\.Template\(|\bEnvironment\(")
    offenders = [f"{f.name}: {line.strip()}" for f in files for line in f.read_text().splitlines()
                 if pattern.search(line) and not line.lstrip().startswith("#")]
    assert not offenders, offenders
