"""Hostile request bodies (hypothesis) against a real tiny-model server: never a 5xx, never a
hang, never a traceback or an internal path in an answer, every answer carries a request id, and
afterwards the server still serves a normal request with every KV block free.

Bodies are near-valid completions and chat requests whose fields take hostile values (integers
past int64, NaN and infinities, lone surrogates, NUL bytes, template syntax, special tokens,
wrong types, long lists), arbitrary JSON, and raw bytes, sent with assorted content types.
The number of cases tried is printed."""

from __future__ import annotations

import http.client
import json
import re

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tpspec.engine.async_engine import AsyncEngine  # noqa: E402
from tpspec.server.api import build_app  # noqa: E402
from tpspec.server.limits import ServerLimits  # noqa: E402

from .utils import ServerThread, assert_openai_error, metrics, request, wait_until  # noqa: E402

MAX_EXAMPLES = 1000
MAX_MODEL_LEN = 64
MAX_OUTPUT_TOKENS = 8  # bounds the work of any request the fuzzer makes valid
NUM_KV_BLOCKS = 64
HTTP_TIMEOUT_S = 30  # a hang fails the case

INTS = st.sampled_from([-2**64, -2**63 - 1, -2**63, -1, 0, 1, 2, 3, 20, 21, 63, 64, 999, 1000, 2**31, 2**63 - 1,
                        2**63, 2**64, 10**30]) | st.integers()
SMALL = st.integers(min_value=1, max_value=8)
FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 0.5, 1.0, 2.0, 1e308, float("nan"), float("inf"),
                          float("-inf")]) | st.floats()
TEXT = st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "{{ 7 * 7 }}", "{% for x in range(10**9) %}x{% endfor %}",
                        "<|im_start|>system\n", "</s>", "<s>", "\u202e", "\n" * 50, "x" * 300, "é" * 100,
                        "'; rm -rf / #", "$(reboot)", "__import__('os')"]) | st.text(max_size=20)
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)


def _maybe(strategy):
    """Mostly values of the field's own type (hostile ones), sometimes any JSON at all."""
    return st.one_of(strategy, strategy, strategy, strategy, strategy, JSON)


SAMPLING = {
    "model": _maybe(st.sampled_from(["tiny", "gpt-4", ""])),
    "n": _maybe(INTS),
    "temperature": _maybe(FLOATS),
    "top_p": _maybe(FLOATS),
    "top_k": _maybe(INTS),
    "min_p": _maybe(FLOATS),
    "seed": _maybe(INTS),
    "stop": _maybe(TEXT | st.lists(TEXT, max_size=20)),
    "stop_token_ids": _maybe(st.lists(INTS, max_size=70)),
    "stream": _maybe(st.booleans()),
    "stream_options": _maybe(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                 "continuous_usage_stats": st.booleans()})),
    "presence_penalty": _maybe(FLOATS),
    "logit_bias": JSON,
    "ignore_eos": _maybe(st.booleans()),
    "skip_special_tokens": _maybe(st.booleans()),
    "include_stop_str_in_output": _maybe(st.booleans()),
    "user": JSON,
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": _maybe(TEXT | st.lists(INTS, max_size=8) | st.lists(st.integers(0, 999), min_size=1, max_size=70)
                      | st.lists(TEXT, max_size=3) | st.lists(st.lists(INTS, max_size=4), max_size=3))},
    optional={**SAMPLING, "max_tokens": _maybe(SMALL | INTS), "logprobs": _maybe(INTS), "echo": _maybe(st.booleans()),
              "best_of": _maybe(INTS), "suffix": _maybe(TEXT)},
)
CONTENT_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | TEXT, "text": _maybe(TEXT)})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | TEXT,
     "content": TEXT | st.none() | st.lists(CONTENT_PART, max_size=3)},
    optional={"name": _maybe(TEXT)},
)
CHAT = st.fixed_dictionaries(
    {"messages": _maybe(st.lists(MESSAGE, max_size=4))},
    optional={**SAMPLING, "max_tokens": _maybe(SMALL | INTS), "max_completion_tokens": _maybe(SMALL | INTS),
              "logprobs": _maybe(st.booleans()), "top_logprobs": _maybe(INTS), "tools": JSON, "tool_choice": JSON,
              "response_format": JSON, "add_generation_prompt": _maybe(st.booleans())},
)
# Valid requests with extreme values: they reach the engine, which must survive them.
ALLOWED_TEXT = TEXT.filter(lambda t: t != "" and "\ud800" not in t and "\udfff" not in t)
ALLOWED_SAMPLING = {
    "model": st.just("tiny"),
    "temperature": st.sampled_from([0.0, 1e-300, 1e-3, 1.0, 1e6, 1e308]) | st.floats(0, 1e308),
    "top_p": st.sampled_from([5e-324, 1e-300, 0.5, 1.0]) | st.floats(0, 1, exclude_min=True),
    "top_k": st.sampled_from([-1, 0, 1, 2, 999, 1000, 1024, 2**31, 2**63 - 1]),
    "min_p": st.sampled_from([0.0, 5e-324, 0.5, 1.0]) | st.floats(0, 1),
    "seed": INTS,
    "stop": st.lists(ALLOWED_TEXT.filter(lambda t: len(t) <= 256), max_size=16),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, 999, 1000, 1023, 2**63 - 1]) | st.integers(0, 2**63 - 1),
                               max_size=64),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
VALID_COMPLETION = st.fixed_dictionaries(
    {"prompt": ALLOWED_TEXT | st.lists(st.integers(0, 999), min_size=1, max_size=40), "max_tokens": SMALL},
    optional={**ALLOWED_SAMPLING, "logprobs": st.integers(0, 20)},
)
VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": ALLOWED_TEXT}), min_size=1, max_size=3)},
    optional={**ALLOWED_SAMPLING, "max_tokens": SMALL, "logprobs": st.just(True), "top_logprobs": st.integers(0, 20)},
)
CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + [
    "application/json; charset=utf-8", "", "application/vnd.api+json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data"])
REQUEST_IDS = st.none() | st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=200)


@st.composite
def hostile_requests(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["valid", "valid", "typed", "typed", "json", "bytes"]))
    if kind == "valid":
        body = json.dumps(draw(VALID_COMPLETION if path == "/v1/completions" else VALID_CHAT)).encode()
    elif kind == "typed":
        body = json.dumps(draw(COMPLETION if path == "/v1/completions" else CHAT)).encode()
    elif kind == "json":
        body = json.dumps(draw(JSON)).encode()
    else:
        body = draw(st.binary(max_size=200))
    headers = {"Content-Type": draw(CONTENT_TYPES)}
    request_id = draw(REQUEST_IDS)
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return path, body, headers


@pytest.fixture(scope="module")
def server(tiny_llama):
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the engine's; restored below for the tests after these
        engine = AsyncEngine.from_args(model=tiny_llama, max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                                       max_num_seqs=8, max_waiting_requests=8)
    limits = ServerLimits(max_output_tokens=MAX_OUTPUT_TOKENS, request_timeout_s=20)
    try:
        with ServerThread(build_app(engine, ["tiny"], limits=limits)) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def _check_answer(status: int, body: bytes, headers: dict, stream_asked: bool) -> None:
    assert status < 500, (status, body[:500])
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", headers.get("x-request-id", "")), headers
    if status >= 400:
        assert_openai_error(status, body, status)
        return
    assert status == 200, (status, body[:300])
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert not stream_asked
        assert json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")


def test_hostile_bodies(server, capsys):
    tried = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(hostile_requests())
    def case(req):
        path, body, headers = req
        tried.append(1)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            status, data, hdrs = resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        try:
            stream_asked = json.loads(body).get("stream") is True
        except (ValueError, AttributeError):
            stream_asked = False
        _check_answer(status, data, hdrs, stream_asked)

    case()
    # Still healthy and serving, nothing leaked, nothing counted as an internal error.
    assert request("GET", server.url + "/health")[0] == 200
    status, body, _ = request("POST", server.url + "/v1/completions",
                              {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    import asyncio

    def all_free():
        s = asyncio.run(server.engine.get_stats())
        return s["num_free_kv_blocks"] == NUM_KV_BLOCKS and s["num_running"] == s["num_waiting"] == 0

    assert wait_until(all_free)
    kinds = {dict(labels)["kind"]: v for (name, labels), v in metrics(server.url).items()
             if name == "tpspec:request_errors_total"}
    assert "internal_error" not in kinds and "engine_dead" not in kinds, kinds
    assert len(tried) >= MAX_EXAMPLES
    with capsys.disabled():
        print(f"\nfuzz: {len(tried)} hostile requests, 0 answered 5xx; errors by kind {dict(sorted(kinds.items()))}")
