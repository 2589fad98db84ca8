"""Soak: 1,000 requests at 64 concurrent connections against a `tpspec serve` process (tiny model,
ngram speculative decoding), through the official async client. A mix of greedy and seeded
sampled requests (some with n = 2 choices), completions and chat, streamed and not, some with stop
strings, and about one in six cancelled (a stream closed after its first chunk, or a non-streamed
request abandoned); prefix caching on (the default).

Asserts: no request fails; every greedy request that completed equals the offline result of a
non-speculative ``LLM`` on the same prompt and parameters; speculation ran (drafts accepted); at
the end every KV block is free (cached ones included) and nothing is running or waiting, blocks
were taken from the cache and the cached ones are reusable; the server's resident memory
grew by less than ``RSS_BOUND_MIB`` between the end of a warm-up round and the end of the soak;
the only errors counted on /metrics are the cancelled requests' client disconnects."""

from __future__ import annotations

import asyncio
import json
import random
import time

import psutil
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .utils import ServerProcess, metrics  # noqa: E402

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)

NUM_REQUESTS = 1000
WARMUP_REQUESTS = 128
CONCURRENCY = 64
RSS_BOUND_MIB = 32
MODEL = "tiny"
ENGINE = dict(max_model_len=128, num_kv_blocks=400, max_num_seqs=64)
# prompt_lookup_min 1: some token repeats in nearly every context, so most steps verify drafts.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}  # k pinned: the soak must draft and verify under load
# One intra-op thread per process: on 2 shared cores, OpenMP threads spinning against the HTTP
# thread and the client cost ten times more than they save on a model this small.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import os\nimport sys\nimport os\nimport sys\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "Tensor parallelism splits the vocabulary across ranks.",
    "a b a b a b a b a b",
    "The lazy dog",
    "print(",
    "def fib(n):",
    "x = 1\ny = 2\n",
    "quick quick quick quick",
    "Ranks split",
]


def _workload(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        r = rng.random()
        kind = "greedy" if r < 0.5 else "sampled" if r < 0.83 else "cancel"
        job = dict(
            i=i, kind=kind, chat=rng.random() < 0.3, stream=kind == "cancel" or rng.random() < 0.5,
            prompt=rng.choice(PROMPTS), max_tokens=rng.choice([4, 8, 12, 16]),
            stop=["\n"] if kind == "greedy" and rng.random() < 0.2 else None,
            seed=rng.randrange(2**31), ignore_eos=rng.random() < 0.5,
            n=2 if kind == "sampled" and rng.random() < 0.2 else 1,
        )
        if kind == "cancel" and rng.random() < 0.3:  # a non-streamed request the client abandons
            job.update(stream=False, abandon_after_s=rng.uniform(0.0, 0.05))
        jobs.append(job)
    return jobs


def _request(job: dict) -> dict:
    kw = dict(model=MODEL, max_tokens=job["max_tokens"], stop=job["stop"], extra_body={"ignore_eos": job["ignore_eos"]})
    if job["kind"] == "greedy":
        kw["temperature"] = 0
    else:
        kw.update(temperature=0.8, top_p=0.95, seed=job["seed"], n=job["n"])
    if job["chat"]:
        kw["messages"] = [{"role": "user", "content": job["prompt"]}]
    else:
        kw["prompt"] = job["prompt"]
    return kw


async def _run_one(client, job: dict) -> dict:
    kw = _request(job)
    api = client.chat.completions if job["chat"] else client.completions
    if job.get("abandon_after_s") is not None:
        task = asyncio.ensure_future(api.create(**kw))
        await asyncio.sleep(job["abandon_after_s"])
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return dict(outcome="cancelled")
        out = task.result()
        return dict(outcome="done", text=_text(job, out.choices[0]), finish=out.choices[0].finish_reason)
    if not job["stream"]:
        out = await api.create(**kw)
        c = out.choices[0]
        assert out.usage.completion_tokens <= job["max_tokens"] * job["n"]
        assert [c.index for c in out.choices] == list(range(job["n"]))
        return dict(outcome="done", text=_text(job, c), finish=c.finish_reason)
    stream = await api.create(stream=True, **kw)
    pieces, finish, finished = [], None, set()
    async with stream:
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            if c.finish_reason:
                finished.add(c.index)
            if c.index:  # another choice of an n = 2 request
                continue
            pieces.append((c.delta.content or "") if job["chat"] else c.text)
            finish = c.finish_reason or finish
            if job["kind"] == "cancel" and any(pieces) and finish is None:
                return dict(outcome="cancelled")  # leaving the block closes the connection mid-stream
    assert finished == set(range(job["n"])), (job, finished)
    return dict(outcome="done", text="".join(pieces), finish=finish)


def _text(job: dict, choice) -> str:
    return choice.message.content if job["chat"] else choice.text


async def _run_all(url: str, jobs: list[dict], concurrency: int = CONCURRENCY) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    gate = asyncio.Semaphore(concurrency)
    active = peak = 0

    async def guarded(job):
        nonlocal active, peak
        async with gate:
            active += 1
            peak = max(peak, active)
            try:
                return await _run_one(client, job)
            except Exception as e:  # noqa: BLE001 - every failure is reported, none is expected
                return dict(outcome="error", error=f"{type(e).__name__}: {e}")
            finally:
                active -= 1

    try:
        results = await asyncio.gather(*(guarded(j) for j in jobs))
    finally:
        await client.close()
    assert peak == concurrency, peak
    return results


def _offline(model: str, jobs: list[dict]) -> dict[tuple, str]:
    """Greedy text of every distinct greedy request, from a non-speculative offline engine."""
    import torch

    from tpspec import LLM, SamplingParams

    threads = torch.get_num_threads()  # the engine sets the process's; given back below

    keys = sorted({_key(j) for j in jobs if j["kind"] == "greedy"})
    with LLM(model, max_model_len=ENGINE["max_model_len"], num_kv_blocks=ENGINE["num_kv_blocks"]) as llm:
        tok = llm.get_tokenizer()
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                       add_special_tokens=False) if chat else p
            for chat, p, _, _, _ in keys
        ]
        params = [SamplingParams(temperature=0, max_tokens=m, stop=list(stop) if stop else None, ignore_eos=ie)
                  for _, _, m, stop, ie in keys]
        outs = llm.generate(prompts, params, use_tqdm=False)
    torch.set_num_threads(threads)
    return {k: o.outputs[0].text for k, o in zip(keys, outs)}


def _key(job: dict) -> tuple:
    return (job["chat"], job["prompt"], job["max_tokens"], tuple(job["stop"] or ()), job["ignore_eos"])


def test_soak(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the offline reference engine
    proc = ServerProcess(
        [tiny_llama, "--served-model-name", MODEL, "--max-model-len", str(ENGINE["max_model_len"]),
         "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
         "--speculative-config", json.dumps(SPEC), "--uvicorn-log-level", "warning"],
        str(tmp_path / "server.log"), env=ONE_THREAD,
    )
    try:
        jobs = _workload(0, WARMUP_REQUESTS + NUM_REQUESTS)
        expected = _offline(tiny_llama, jobs)  # while the server starts
        proc.wait_ready()
        server = psutil.Process(proc.proc.pid)
        asyncio.run(_run_all(proc.url, jobs[:WARMUP_REQUESTS]))
        rss_before = server.memory_info().rss
        start = time.monotonic()
        results = asyncio.run(_run_all(proc.url, jobs[WARMUP_REQUESTS:]))
        elapsed = time.monotonic() - start
        rss_after = server.memory_info().rss
        after = metrics(proc.url)
        # The cached blocks are reusable: a chat prompt the soak sent takes its blocks again.
        again = dict(kind="greedy", chat=True, stream=False, prompt=PROMPTS[0], max_tokens=4, stop=None, seed=0,
                     ignore_eos=True, n=1)
        assert asyncio.run(_run_all(proc.url, [again], concurrency=1))[0]["outcome"] == "done"
        reused = metrics(proc.url)[("tpspec:prefix_cache_hits_total", ())] - after[("tpspec:prefix_cache_hits_total", ())]
        assert proc.stop() == 0
    finally:
        proc.stop()

    errors = [(j, r) for j, r in zip(jobs[WARMUP_REQUESTS:], results) if r["outcome"] == "error"]
    assert not errors, errors[:5]
    done = [(j, r) for j, r in zip(jobs[WARMUP_REQUESTS:], results) if r["outcome"] == "done"]
    for job, r in done:
        assert r["finish"] in ("length", "stop"), (job, r)
    greedy = [(j, r) for j, r in done if j["kind"] == "greedy"]
    mismatches = [(j, r["text"], expected[_key(j)]) for j, r in greedy if r["text"] != expected[_key(j)]]
    assert not mismatches, mismatches[:5]
    cancelled = sum(r["outcome"] == "cancelled" for r in results)
    assert cancelled >= NUM_REQUESTS // 10

    assert after[("tpspec:num_free_kv_blocks", ())] == after[("tpspec:num_kv_blocks", ())] == ENGINE["num_kv_blocks"]
    assert after[("tpspec:prefix_cache_hits_total", ())] > 0 and reused >= 16
    assert after[("tpspec:num_requests_running", ())] == after[("tpspec:num_requests_waiting", ())] == 0
    drafted = after[("tpspec:spec_decode_num_draft_tokens_total", ())]
    accepted = after[("tpspec:spec_decode_num_accepted_tokens_total", ())]
    assert drafted > 100 and accepted > 0
    errors_by_kind = {dict(labels)["kind"]: v for (name, labels), v in after.items()
                      if name == "tpspec:request_errors_total"}
    assert set(errors_by_kind) <= {"client_disconnected"}, errors_by_kind
    growth_mib = (rss_after - rss_before) / 2**20
    assert growth_mib < RSS_BOUND_MIB, growth_mib
    with capsys.disabled():
        print(f"\nsoak: {len(results)} requests at {CONCURRENCY} concurrent in {elapsed:.1f} s; "
              f"{len(greedy)} greedy checked against offline, {cancelled} cancelled, 0 failed; "
              f"server RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB "
              f"(growth {growth_mib:+.1f} MiB, bound {RSS_BOUND_MIB}); draft tokens {drafted:.0f}, accepted {accepted:.0f}")
