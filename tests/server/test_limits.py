"""Per-request limits and the bounded queue, against a real tiny-model engine.

Each limit breached is a 4xx naming the limit and its flag; values the engine would choke on
(top_k past int64, lone surrogates, JSON nested or numbers too deep or long) are 400s, not a dead
engine. Overload: a burst beyond max_num_seqs + max_waiting_requests gets 429 with Retry-After,
every accepted request completes in full, and nothing leaks."""

from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tpspec.engine.async_engine import AsyncEngine  # noqa: E402
from tpspec.server.api import build_app  # noqa: E402
from tpspec.server.limits import ServerLimits  # noqa: E402

from .utils import ServerThread, assert_openai_error, metrics, request, wait_until  # noqa: E402

MAX_NUM_SEQS, MAX_WAITING = 2, 2
NUM_KV_BLOCKS = 40
LIMITS = ServerLimits(max_request_body_bytes=8192, max_prompt_tokens=40, max_output_tokens=100, max_stop_strings=2,
                      max_stop_string_length=8, max_stop_token_ids=3)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        engine = AsyncEngine.from_args(model=tiny_llama, max_model_len=128, num_kv_blocks=NUM_KV_BLOCKS,
                                       max_num_seqs=MAX_NUM_SEQS, max_waiting_requests=MAX_WAITING)
    try:
        with ServerThread(build_app(engine, ["tiny"], limits=LIMITS)) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def _post(server, path: str, body, headers: dict | None = None):
    return request("POST", server.url + path, body, headers)


def _limit_error(result, param: str, flag: str) -> None:
    err = assert_openai_error(*result[:2], 400)
    assert err["code"] == "limit_exceeded" and err["param"] == param and flag in err["message"], err


def test_body_size_content_type_and_json_shape(server):
    big = {"model": "tiny", "prompt": "a" * 9000}
    err = assert_openai_error(*_post(server, "/v1/completions", big)[:2], 413)
    assert err["code"] == "request_too_large" and "8192" in err["message"] and "--max-request-body-bytes" in err["message"]
    # Chunked, with no Content-Length to refuse it by: cut off as it arrives.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + b"1000\r\n" + b" " * 4096 + b"\r\n" + b"1000\r\n" + b" " * 4096
                  + b"\r\n" + b"10\r\n" + b" " * 16 + b"\r\n0\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    status, body, _ = _post(server, "/v1/completions", "{}", {"Content-Type": "text/plain"})
    assert assert_openai_error(status, body, 415)["code"] == "unsupported_media_type"
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert _post(server, "/v1/completions", ok, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    for raw in ("[" * 3000 + "]" * 3000, '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", '{"prompt": "\\ud800"}'):
        err = assert_openai_error(*_post(server, "/v1/completions", raw)[:2], 400)
        assert err["code"] in ("invalid_json", None) and err["message"], err


@pytest.mark.parametrize("path,body,param,flag", [
    ("/v1/completions", {"prompt": list(range(3, 44))}, "prompt", "--max-prompt-tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b " * 30}]}, "messages", "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 101}, "max_tokens", "--max-output-tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 101}, "max_completion_tokens",
     "--max-output-tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": "123456789"}, "stop", "--max-stop-string-length"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5, 6, 7, 8]}, "stop_token_ids", "--max-stop-token-ids"),
])
def test_limits_name_themselves(server, path, body, param, flag):
    _limit_error(_post(server, path, {"model": "tiny", **body}), param, flag)


def test_values_the_engine_would_choke_on_are_400s(server):
    err = assert_openai_error(*_post(server, "/v1/completions", {"prompt": "hi", "top_k": 2**63})[:2], 400)
    assert err["param"] == "top_k"
    err = assert_openai_error(*_post(server, "/v1/completions", {"prompt": "hi", "n": 0})[:2], 400)
    assert err["param"] == "n"
    err = assert_openai_error(*_post(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "a\ud800b"}]})[:2], 400)
    assert err["param"] == "messages"
    # The largest values allowed reach the engine, which survives them.
    extreme = {"prompt": "hi", "max_tokens": 3, "top_k": 2**63 - 1, "seed": -2**70, "temperature": 1e308,
               "top_p": 5e-324, "stop_token_ids": [2**63 - 1], "ignore_eos": True}
    status, body, _ = _post(server, "/v1/completions", extreme)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    assert server.engine.is_healthy


def test_output_cap_is_the_default(server):
    status, body, _ = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 100


def test_burst_beyond_the_queue_gets_429_and_every_accepted_request_completes(server, capsys):
    before = metrics(server.url)
    burst = 24
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    results: list = [None] * burst
    go = threading.Event()

    def send(i):
        go.wait()
        results[i] = _post(server, "/v1/completions", body)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(burst)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    rejected = [r for r in results if r[0] == 429]
    accepted = [json.loads(r[1]) for r in results if r[0] == 200]
    assert rejected and len(accepted) >= MAX_NUM_SEQS + MAX_WAITING, statuses
    for status, raw, headers in rejected:
        err = assert_openai_error(status, raw, 429)
        assert err["code"] == "too_many_requests" and err["type"] == "rate_limit_error"
        assert headers["retry-after"] == "1"
    # Every accepted request ran to the end, with the same (greedy) text.
    assert {(a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]) for a in accepted} == {(100, "length")}
    assert len({a["choices"][0]["text"] for a in accepted}) == 1

    def idle():
        m = metrics(server.url)
        return m[("tpspec:num_free_kv_blocks", ())] == NUM_KV_BLOCKS and m[("tpspec:num_requests_running", ())] == 0
    assert wait_until(idle)
    after = metrics(server.url)
    key = ("tpspec:request_errors_total", (("kind", "too_many_requests"),))
    assert after[key] - before.get(key, 0) == len(rejected)
    assert server.engine.num_requests == 0
    with capsys.disabled():
        print(f"\noverload: burst of {burst} at capacity {MAX_NUM_SEQS + MAX_WAITING}: {len(accepted)} accepted and "
              f"completed in full, {len(rejected)} answered 429 with Retry-After, 0 lost")
