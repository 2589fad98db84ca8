"""Structured outputs through the OpenAI-compatible API, driven by the official ``openai`` client:
``response_format`` (``json_schema`` and ``json_object``) on chat completions and completions,
vLLM's ``structured_outputs`` and the older ``guided_*`` fields in ``extra_body``, streaming; and
every malformed constraint answered 400 with the field named. A real tiny-model engine, one
module-scoped server."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from .utils import assert_openai_error, openai_client, request, serving  # noqa: E402

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe something as JSON"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serving([MODEL], model=tiny_llama, max_model_len=256, num_kv_blocks=64, block_size=16, max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_response_format_json_schema_on_chat(client):
    for seed in (None, 1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0 if seed is None else 1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_on_completions(client):
    # greedy on this random model closes its object after ~250 tokens (keys of odd characters)
    r = client.completions.create(model=MODEL, prompt="import os", max_tokens=250, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    obj = json.loads(r.choices[0].text)
    assert isinstance(obj, dict) and obj, r.choices[0].text


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"regex": r"[a-c]{2}-[0-9]{2}"}}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": r"[0-9]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_extra_body_constraints(client, body, check):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=120, temperature=0.8, seed=3, extra_body=body)
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].text), r.choices[0].text


def test_a_streamed_constrained_answer_is_whole(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Unclosed"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "only one"),
])
def test_malformed_constraints_are_400_naming_the_field(server, extra, param, message):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **extra}
    status, raw, _ = request("POST", server.url + "/v1/chat/completions", body)
    err = assert_openai_error(status, raw, 400)
    assert err["param"] == param and message in err["message"], err
    # The engine is unharmed: the next request is served.
    ok, _, _ = request("POST", server.url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
    assert ok == 200
