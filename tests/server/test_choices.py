"""``n > 1`` through the OpenAI-compatible API with the official ``openai`` client: n choices with
their indices on completions and chat, streamed and not (each streamed choice reassembles to the
non-streamed one of the same seeded request), usage counting the prompt once and every choice's
tokens, the prompt computed once, and n out of range answered 400. A real tiny-model engine."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from .utils import assert_openai_error, engine_stats, openai_client, request, serving  # noqa: E402

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return a + b\n\nimport os\nimport sys\n\nclass Tensor"


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serving([MODEL], model=tiny_llama, max_model_len=256, num_kv_blocks=64, block_size=8, max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_completions_with_three_choices(client, server):
    before = engine_stats(server)["prefix_cache_hits"]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3, n=3)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3  # independent draws
    assert r.usage.completion_tokens == 30 and r.usage.total_tokens == r.usage.prompt_tokens + 30
    # The 2 later choices took the first one's full prompt blocks.
    hits = engine_stats(server)["prefix_cache_hits"] - before
    assert hits == 2 * ((r.usage.prompt_tokens - 1) // 8 * 8)
    texts, reasons, usage = _streamed(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in r.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 30 and usage.prompt_tokens == r.usage.prompt_tokens
    assert client.completions.create(**kw).choices[1].text == r.choices[1].text  # seeded: the same choices again


def test_chat_with_two_choices(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=8, temperature=0.9,
              seed=5, n=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.role == "assistant" for c in r.choices)
    texts, reasons, _ = _streamed(client.chat.completions.create(**kw, stream=True))
    assert texts == {c.index: c.message.content for c in r.choices} and set(reasons) == {0, 1}


@pytest.mark.parametrize("n", [0, 65])
def test_n_out_of_range_is_a_400(server, n):
    status, body = request("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "a", "n": n})[:2]
    assert assert_openai_error(status, body, 400)["param"] == "n"
