"""The OpenAI-compatible API against a real tiny-model engine, driven by the official client.

One module-scoped server (uvicorn in a background thread on a free loopback port, the engine on
its own thread)."""

from __future__ import annotations

import http.client
import json
import re
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from .utils import (  # noqa: E402
    assert_openai_error,
    engine_stats,
    metrics,
    open_stream,
    openai_client,
    request,
    serving,
    wait_until,
)

MODEL = "tiny"
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 40
PROMPT = "import os\nimport sys\n"
MESSAGES = [{"role": "user", "content": "Say hi"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serving([MODEL, "tiny-alias"], model=tiny_llama, max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                 block_size=16, max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _all_blocks_free(server) -> bool:
    s = engine_stats(server)
    return s["num_free_kv_blocks"] == s["num_kv_blocks"] == NUM_KV_BLOCKS and s["num_running"] == s["num_waiting"] == 0


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "tiny-alias"]
    assert request("GET", server.url + "/health")[0] == 200
    status, body, _ = request("GET", server.url + "/version")
    assert status == 200 and json.loads(body)["version"]
    # Any served name is accepted; the first one is reported.
    out = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=2, **GREEDY)
    assert out.model == MODEL


def test_completion_stream_matches_non_stream_and_usage(server, client):
    tok = server.engine.tokenizer
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.object == "text_completion"
    assert full.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert all(c.usage is None for c in chunks[:-1])

    # The same prompt as token ids gives the same tokens.
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=24, **GREEDY)
    assert by_ids.choices[0].text == choice.text and by_ids.usage == full.usage


def test_chat_stream_matches_non_stream_and_usage(server, client):
    tok = server.engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), 20)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in content) == choice.message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def _stop_string(text: str) -> tuple[str, str]:
    """A two-character stop string from inside ``text`` and the text expected before it."""
    for i in range(1, len(text) - 1):
        stop = text[i : i + 2]
        if "\ufffd" not in text[: i + 2] and text.index(stop) == i:
            return stop, text[:i]
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop, expected = _stop_string(text)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop, "never-appears"], **GREEDY)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
    else:
        finish = client.completions.create(**kw).choices[0]
        got = finish.text
    assert got == expected
    assert finish.finish_reason == "stop" and finish.model_extra["stop_reason"] == stop
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}})
    assert kept.choices[0].text == expected + stop


def test_seed_reproducibility(client):
    def sample(seed, **kw):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}, **kw).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == first
    assert any(sample(s) != first for s in (1, 2, 3))
    # Sampling knobs are accepted and still reproducible.
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.8, top_p=0.9, seed=7,
                extra_body={"top_k": 20, "min_p": 0.01, "ignore_eos": True})
    a = client.chat.completions.create(**chat).choices[0].message.content
    assert client.chat.completions.create(**chat).choices[0].message.content == a


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 1 <= len(top) <= 4
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the chosen token is the top one

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                                          top_logprobs=2, stream=True, **GREEDY) if c.choices]
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    assert chat.choices[0].logprobs is not None
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY).choices[0].logprobs is None


# (client call or raw body, endpoint, expected status, expected param or None)
LONG = [5] * (MAX_MODEL_LEN + 10)
BAD_COMPLETIONS = {
    "malformed json": ('{"model": "tiny", "prompt": ', 400, None),
    "not an object": ("[1, 2]", 400, None),
    "missing prompt": ({"model": MODEL}, 400, "prompt"),
    "prompt wrong type": ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    "max_tokens as string": ({"model": MODEL, "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    "max_tokens float": ({"model": MODEL, "prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    "negative max_tokens": ({"model": MODEL, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    "zero max_tokens": ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "huge max_tokens": ({"model": MODEL, "prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    "prompt too long": ({"model": MODEL, "prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    "token id out of range": ({"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt"),
    "empty prompt": ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    "batch of prompts": ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    "negative temperature": ({"model": MODEL, "prompt": "a", "temperature": -0.5}, 400, "temperature"),
    "temperature as string": ({"model": MODEL, "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    "top_p above 1": ({"model": MODEL, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    "top_p zero": ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    "n above the most choices": ({"model": MODEL, "prompt": "a", "n": 65}, 400, "n"),
    "logprobs too many": ({"model": MODEL, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    "stream not a bool": ({"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
    "stop wrong type": ({"model": MODEL, "prompt": "a", "stop": 3}, 400, "stop"),
    "unknown model": ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
}
BAD_CHAT = {
    "no messages": ({"model": MODEL, "messages": []}, 400, "messages"),
    "message without role": ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    "image part": ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
    "top_logprobs without logprobs": ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    "huge max_completion_tokens": ({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    "negative max_tokens": ({"model": MODEL, "messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens"),
    "unknown model": ({"model": "nope", "messages": MESSAGES}, 404, "model"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS), ids=list(BAD_COMPLETIONS))
def test_bad_completion_requests(server, client, case):
    body, status, param = BAD_COMPLETIONS[case]
    code, raw, _ = request("POST", server.url + "/v1/completions", body)
    err = assert_openai_error(code, raw, status)
    assert err["param"] == param, err
    if case.startswith(("huge", "prompt too long")):
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("case", list(BAD_CHAT), ids=list(BAD_CHAT))
def test_bad_chat_requests(server, case):
    body, status, param = BAD_CHAT[case]
    code, raw, _ = request("POST", server.url + "/v1/chat/completions", body)
    err = assert_openai_error(code, raw, status)
    assert err["param"] == param, err


def test_errors_through_the_official_client_then_server_still_serves(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", temperature=-1.0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=2.0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found"
    err = assert_openai_error(*request("GET", server.url + "/v1/nothing-here")[:2], 404)
    assert err["type"] == "not_found_error"
    assert request("GET", server.url + "/v1/completions")[0] == 405
    # ... and a normal request works afterwards, with nothing leaked.
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY)
    assert out.usage.completion_tokens == 4
    assert wait_until(lambda: _all_blocks_free(server))


def test_concurrent_requests_match_sequential(client):
    prompts = ["def add(a, b):", "The quick brown fox", PROMPT, "Tensor parallelism"]
    seq = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        results[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, **GREEDY).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == seq


def test_metrics(server, client):
    before = metrics(server.url)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    after = metrics(server.url)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("tpspec:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("tpspec:generation_tokens_total") == out.usage.completion_tokens == 10
    assert delta("tpspec:request_success_total", (("finished_reason", "length"),)) == 1
    for hist in ("tpspec:time_to_first_token_seconds", "tpspec:time_per_output_token_seconds",
                 "tpspec:e2e_request_latency_seconds"):
        assert delta(hist + "_count") == 1
        assert delta(hist + "_sum") > 0
    assert after[("tpspec:num_requests_running", ())] == 0
    assert after[("tpspec:num_requests_waiting", ())] == 0
    assert after[("tpspec:kv_cache_usage_perc", ())] == 0.0
    assert after[("tpspec:num_free_kv_blocks", ())] == after[("tpspec:num_kv_blocks", ())] == NUM_KV_BLOCKS
    # No speculative config on this server: the spec counters are absent; comm is there (empty at TP 1).
    assert not any(name.startswith("tpspec:spec_decode") for name, _ in after)


def _read_first_event(resp) -> dict:
    while True:
        line = resp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            return json.loads(line[6:])


def test_client_disconnect_mid_stream_frees_blocks(server):
    before = metrics(server.url)
    conn, resp = open_stream(server.url + "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 10, "stream": True, "ignore_eos": True,
        "temperature": 0})
    assert resp.status == 200
    first = _read_first_event(resp)
    assert first["choices"][0]["finish_reason"] is None
    conn.sock.shutdown(2)
    conn.close()
    assert wait_until(lambda: _all_blocks_free(server))
    after = metrics(server.url)
    aborted = ("tpspec:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    generated = after[("tpspec:generation_tokens_total", ())] - before[("tpspec:generation_tokens_total", ())]
    assert generated < MAX_MODEL_LEN - 10  # stopped early, not run to max_tokens


def test_client_disconnect_while_waiting_frees_blocks(server):
    before = metrics(server.url)
    host, port = re.match(r"http://([^:]+):(\d+)", server.url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": MODEL, "messages": MESSAGES, "max_tokens": 100, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    assert wait_until(lambda: engine_stats(server)["num_running"] == 1, timeout=20)
    conn.sock.shutdown(2)
    conn.close()
    assert wait_until(lambda: _all_blocks_free(server))
    after = metrics(server.url)
    aborted = ("tpspec:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    generated = after[("tpspec:generation_tokens_total", ())] - before[("tpspec:generation_tokens_total", ())]
    assert generated < 100  # stopped early, not run to max_tokens
