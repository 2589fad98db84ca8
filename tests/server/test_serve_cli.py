"""`tpspec serve` as a real process: TP 2, speculative decoding and an API key.

Proves: the CLI flags work (vLLM names, positional MODEL, --port 0); TP workers started from the
engine thread live as long as the server; every endpoint but /health needs the key; speculative
greedy output equals offline non-speculative TP 1 output; the spec-decode and communication
counters move on /metrics; SIGTERM shuts down cleanly (exit 0) with no worker left behind.

The drafter is the tiny model itself, so every greedy draft must be accepted."""

from __future__ import annotations

import json
import os

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from .utils import ServerProcess, assert_openai_error, metrics, request  # noqa: E402

MODEL = "tiny-spec"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEC_TOKENS = 3
ENGINE = dict(max_model_len=128, num_kv_blocks=32)
PROMPT = "import os\nimport sys\n"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve") / "server.log")
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": SPEC_TOKENS, "adaptive": False}
    proc = ServerProcess(
        [tiny_llama, "--served-model-name", MODEL, "--api-key", KEY, "--tensor-parallel-size", "2",
         "--speculative-config", json.dumps(spec), "--max-model-len", str(ENGINE["max_model_len"]),
         "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--trust-remote-code", "--gpu-memory-utilization", "0.9"],
        log,
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/version")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(server, method, path, headers):
    body = {"model": MODEL, "prompt": "a"} if method == "POST" else None
    err = assert_openai_error(*request(method, server.url + path, body, headers)[:2], 401)
    assert err["code"] == "invalid_api_key" and KEY not in err["message"]


def test_health_needs_no_key_and_the_right_key_works(server, client):
    assert request("GET", server.url + "/health")[0] == 200
    assert request("GET", server.url + "/version", headers=AUTH)[0] == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="a", max_tokens=2)
    # An unauthenticated bad request is 401, not 400: the key is checked first.
    assert request("POST", server.url + "/v1/completions", "{broken")[0] == 401


def test_speculative_greedy_is_lossless_and_counters_move(server, client, tiny_llama):
    from tpspec import LLM, SamplingParams

    before = metrics(server.url, AUTH)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metrics(server.url, AUTH)
    assert out.usage.completion_tokens == 24

    with LLM(tiny_llama, **ENGINE) as llm:
        ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert out.choices[0].text == ref[0].outputs[0].text

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    drafts = delta("tpspec:spec_decode_num_drafts_total")
    draft_tokens = delta("tpspec:spec_decode_num_draft_tokens_total")
    accepted = delta("tpspec:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and drafts <= draft_tokens <= SPEC_TOKENS * drafts
    assert accepted == draft_tokens  # the drafter is the target itself: greedy drafts all accepted
    per_pos = {dict(labels)["position"]: v for (name, labels), v in after.items()
               if name == "tpspec:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sorted(per_pos) == ["0", "1", "2"]
    assert sum(per_pos.values()) == after[("tpspec:spec_decode_num_accepted_tokens_total", ())]
    # TP 2: every layer all-reduces; the bytes and calls per site are on /metrics.
    sites = {dict(labels)["site"] for (name, labels) in after if name == "tpspec:comm_bytes_total"}
    assert sites and all(delta("tpspec:comm_calls_total", (("site", s),)) >= 0 for s in sites)
    assert sum(delta("tpspec:comm_bytes_total", (("site", s),)) for s in sites) > 0
    assert delta("tpspec:generation_tokens_total") == 24


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_sigterm_shuts_down_cleanly(server):
    workers = _children(server.proc.pid)
    assert workers, "a TP 2 server has a worker process"
    assert server.stop() == 0
    assert not any(_alive(p) for p in workers)
    log = open(server.log_path).read()
    assert "engine shut down" in log
    assert "--trust-remote-code has no effect" in log and "--gpu-memory-utilization is ignored" in log
