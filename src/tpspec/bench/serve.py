"""``tpspec bench serve``: an async load generator for any OpenAI-compatible server.

Sends a workload of prompts (HumanEval text or seeded random token ids) to ``/v1/completions`` or
``/v1/chat/completions``, every request streamed (SSE with ``stream_options.include_usage``), with
at most ``max_concurrency`` in flight and Poisson arrivals at ``request_rate`` (seeded; all at once
when infinite). Each request's start, first-token and chunk arrival times and token counts become a
``RequestRecord``; ``bench.metrics`` turns them into ``vllm bench serve``'s figures. ``/metrics`` is
scraped before and after the run for the speculative-decoding counters; a server without them
(vLLM without speculation, llama.cpp) just yields ``None`` for those figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx2 as httpx
import numpy as np
from tqdm import tqdm

from tpspec.bench.datasets import DATASETS, HUMANEVAL_SIZE, load_prompts
from tpspec.bench.machine import machine_info
from tpspec.bench.metrics import (
    MetricsSnapshot,
    RequestRecord,
    compute_metrics,
    parse_metrics,
    prefix_cache_delta,
    spec_decode_delta,
)
from tpspec.sampling_params import CLI_SAMPLING_DEFAULTS

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
REQUEST_TIMEOUT_S = 6 * 3600  # as vLLM's client: a benchmark request is allowed to be very slow
CONNECT_TIMEOUT_S = 30
ERROR_CHARS = 500  # how much of an error body a record keeps


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Workload:
    """What to send and how fast; the same workload can be replayed against several servers."""

    dataset: str = "humaneval"
    num_prompts: int = 64
    endpoint: str = COMPLETIONS
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    temperature: float = CLI_SAMPLING_DEFAULTS["temperature"]
    max_tokens: int = CLI_SAMPLING_DEFAULTS["max_tokens"]
    seed: int = 0  # arrivals, random prompts, and per-request sampling seeds (seed + index)
    ignore_eos: bool = False
    num_warmups: int = 0  # requests sent (and waited for) before the measured run
    random_input_len: int = 128
    random_vocab_size: int | None = None  # the tokenizer's vocabulary size; required for "random"

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        _check_int("num_prompts", self.num_prompts, 1)
        if self.max_concurrency is not None:
            _check_int("max_concurrency", self.max_concurrency, 1)
        if not _is_number(self.request_rate) or not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all requests at once), got {self.request_rate!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("seed", self.seed, 0)
        _check_int("num_warmups", self.num_warmups, 0)
        _check_int("random_input_len", self.random_input_len, 1)
        if self.dataset == "random":
            if self.random_vocab_size is None:
                raise ValueError("random_vocab_size (--random-vocab-size) is required for dataset 'random': "
                                 "the served tokenizer's vocabulary size")
            _check_int("random_vocab_size", self.random_vocab_size, 1)
            if self.endpoint != COMPLETIONS:
                raise ValueError(f"dataset 'random' sends token ids, which only {COMPLETIONS} accepts; "
                                 f"got endpoint {self.endpoint!r}")


@dataclass(frozen=True)
class Target:
    """The server under test."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None  # None: the first model that /v1/models lists
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def workload_prompts(w: Workload) -> list[str] | list[list[int]]:
    """``num_prompts`` prompts; HumanEval is cycled when more than its 164 are asked for."""
    if w.dataset == "humaneval":
        base = load_prompts("humaneval", min(w.num_prompts, HUMANEVAL_SIZE))
        if w.num_prompts > HUMANEVAL_SIZE:
            logger.info("HumanEval has %d prompts; cycling them for %d requests", HUMANEVAL_SIZE, w.num_prompts)
        return [base[i % len(base)] for i in range(w.num_prompts)]
    return load_prompts(w.dataset, w.num_prompts, input_len=w.random_input_len, seed=w.seed,
                        vocab_size=w.random_vocab_size)


def request_payload(w: Workload, model: str, prompt: str | list[int], index: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": w.max_tokens, "temperature": w.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if w.endpoint == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if w.temperature > 0:
        body["seed"] = w.seed + index  # reproducible sampled runs, the same across servers
    if w.ignore_eos:
        body["ignore_eos"] = True
    return body


async def arrivals(n: int, rate: float, seed: int) -> AsyncIterator[int]:
    """Request indices 0..n-1, spaced by exponential gaps of mean 1/rate (Poisson) unless rate is inf."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


def _chunk_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, headers: dict[str, str],
                       prompt_len: int = 0) -> RequestRecord:
    """Stream one request. The first token arrives with the first chunk that carries text or a
    finish reason (a chat role preamble, sent before any token, does not count); every chunk with
    a choice from then on counts. Output tokens come from the usage chunk, else from the number of
    chunks that carried text."""
    chat = "messages" in payload
    start = time.perf_counter()
    times: list[float] = []
    text_chunks: list[str] = []
    usage: dict = {}

    def failed(error: str) -> RequestRecord:
        return RequestRecord(start=start, chunk_times=tuple(times), success=False, error=error[:ERROR_CHARS])

    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                return failed(f"HTTP {resp.status_code}: {body}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    return failed(f"stream error: {json.dumps(event['error'])}")
                if choices := event.get("choices"):
                    text = _chunk_text(choices[0], chat)
                    if times or text or choices[0].get("finish_reason"):
                        times.append(now)
                        if text:
                            text_chunks.append(text)
                usage = event.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return failed(f"{type(e).__name__}: {e}")
    if not times:
        return failed("the stream ended without any token")
    return RequestRecord(
        start=start, chunk_times=tuple(times),
        prompt_tokens=int(usage.get("prompt_tokens") or prompt_len),
        output_tokens=int(usage.get("completion_tokens") or len(text_chunks)),
        success=True, generated_text="".join(text_chunks),
    )


async def first_model(client: httpx.AsyncClient, target: Target) -> str:
    try:
        resp = await client.get(target.base_url + "/v1/models", headers=target.headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"could not read the model name from {target.base_url}/v1/models "
                           f"(pass --model): {type(e).__name__}: {e}") from None


async def scrape_metrics(client: httpx.AsyncClient, target: Target) -> MetricsSnapshot | None:
    """The server's ``/metrics``, parsed; None when it has none or it is not Prometheus text."""
    try:
        resp = await client.get(target.base_url + "/metrics", headers=target.headers)
        if resp.status_code != 200:
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError) as e:
        logger.debug("no usable /metrics at %s: %s", target.base_url, e)
        return None


async def run_benchmark(target: Target, w: Workload, show_progress: bool = True) -> dict[str, Any]:
    """Warm up, run the workload, and return the figures (``BenchmarkMetrics`` fields) with the
    run's settings and per-request arrays, shaped like ``vllm bench serve``'s result JSON."""
    prompts = workload_prompts(w)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await first_model(client, target)
        url = target.base_url + w.endpoint
        semaphore = asyncio.Semaphore(w.max_concurrency) if w.max_concurrency else None

        async def one(i: int, bar: tqdm | None = None) -> RequestRecord:
            prompt = prompts[i % len(prompts)]
            payload = request_payload(w, model, prompt, i)
            prompt_len = len(prompt) if isinstance(prompt, list) else 0
            if semaphore is None:
                record = await send_request(client, url, payload, target.headers, prompt_len)
            else:
                async with semaphore:
                    record = await send_request(client, url, payload, target.headers, prompt_len)
            if bar is not None:
                bar.update(1)
            return record

        if w.num_warmups:
            logger.info("warming up with %d request(s)", w.num_warmups)
            for r in await asyncio.gather(*(one(i) for i in range(w.num_warmups))):
                if not r.success:
                    raise RuntimeError(f"a warm-up request to {url} failed; check the benchmark arguments: {r.error}")

        before = await scrape_metrics(client, target)
        logger.info("benchmarking %s (%s): %d prompts, request rate %s, max concurrency %s",
                    url, model, w.num_prompts, w.request_rate, w.max_concurrency)
        # No garbage collection while timing (as timeit): a full one took 25-100 ms here near the
        # end of a 16-request run, a pause in reading every stream, counted in their latencies.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with tqdm(total=w.num_prompts, desc="requests", disable=not show_progress) as bar:
                tasks = []
                bench_start = time.perf_counter()
                async for i in arrivals(w.num_prompts, w.request_rate, w.seed):
                    tasks.append(asyncio.create_task(one(i, bar)))
                records = await asyncio.gather(*tasks)
                duration = time.perf_counter() - bench_start
        finally:
            if gc_was_enabled:
                gc.enable()
        after = await scrape_metrics(client, target)

    failures = [r.error for r in records if not r.success]
    if failures:
        logger.warning("%d of %d requests failed; first error: %s", len(failures), len(records), failures[0])
    figures = compute_metrics(records, duration, spec_decode_delta(before, after))
    settings = dataclasses.asdict(w)
    settings["request_rate"] = w.request_rate if math.isfinite(w.request_rate) else "inf"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "machine": machine_info(),  # where the client ran (the server's machine too, on loopback)
        "base_url": target.base_url,
        "model_id": model,
        **settings,
        **figures.to_dict(),
        **(prefix_cache_delta(before, after) or {}),
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "generated_texts": [r.generated_text for r in records],
        "ttfts": [r.ttft if r.success else None for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "errors": [r.error for r in records],
    }


def benchmark(target: Target, w: Workload, show_progress: bool = True) -> dict[str, Any]:
    """``run_benchmark`` from synchronous code."""
    return asyncio.run(run_benchmark(target, w, show_progress))
