"""One request's answer, streamed or not: its outputs with timing and the deadline, SSE events
(a last ``data: {"error": ...}`` event if it fails mid-stream), the final outputs of a
non-streamed request, and the abort when the client goes away. A request with ``n`` choices runs
as n engine requests (``SamplingParams.choices``), whose streams are merged here, each output
with its choice's index."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tpspec.engine.async_engine import RequestStream
from tpspec.engine.outputs import RequestOutput
from tpspec.executor.executor import EngineDeadError
from tpspec.server.metrics import ServerMetrics
from tpspec.server.middleware import error_kind
from tpspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, usage

logger = logging.getLogger(__name__)


def dump_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class RequestTimer:
    """Arrival, first token and end of one request (all ``n`` of its choices), for the latency
    histograms and the request log."""

    def __init__(self, metrics: ServerMetrics, log: dict, n: int = 1) -> None:
        self.metrics = metrics
        self.log = log
        self.n = n
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.ended: dict[str, tuple[int, str | None]] = {}  # per finished choice: (tokens, finish reason)
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if self.first_token is None and out.new_token_ids:
            self.first_token = time.monotonic()
        if out.finished and out.request_id not in self.ended:
            c = out.outputs[0]
            self.ended[out.request_id] = (len(c.token_ids), c.finish_reason)
            if len(self.ended) == self.n and not self.done:  # the last choice: the request's end
                self.done = True
                latency = time.monotonic() - self.arrival
                ttft = None if self.first_token is None else self.first_token - self.arrival
                tokens = sum(t for t, _ in self.ended.values())
                self.metrics.observe_request(ttft, latency, tokens, c.finish_reason)
                self.log.update(completion_tokens=tokens, finish_reason=c.finish_reason)

    def on_gone(self, reason: str = "abort", request_id: str | None = None) -> None:
        """The request (or its choice ``request_id``) ended without a finished output (client gone,
        engine error, deadline)."""
        if not self.done and request_id not in self.ended:
            self.done = True
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
            self.log["finish_reason"] = reason


async def iterate_outputs(stream: RequestStream, timer: RequestTimer, deadline: float | None) -> AsyncIterator[RequestOutput]:
    """The request's outputs, with timing; closing early (client gone) or the deadline passing
    aborts the request. An ``APIError`` raised here is the request's answer (deadline, shutdown)."""
    expiry = None
    if deadline is not None:
        timeout = APIError("The request did not finish within this server's request timeout (--request-timeout).",
                           504, code="request_timeout")
        expiry = asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), stream.fail, timeout)
    try:
        async for out in stream:
            timer.on_output(out)
            yield out
    except EngineDeadError:
        timer.on_gone("error")
        raise
    except APIError as e:
        timer.on_gone("timeout" if e.code == "request_timeout" else "error")
        raise
    finally:
        if expiry is not None:
            expiry.cancel()
        stream.close()
        timer.on_gone("abort", stream.request_id)


async def merged_outputs(streams: list[RequestStream], timer: RequestTimer,
                         deadline: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every choice's stream as they come; the first error ends them
    all, and closing early aborts every choice still running."""
    if len(streams) == 1:
        async for out in iterate_outputs(streams[0], timer, deadline):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in iterate_outputs(stream, timer, deadline):
                queue.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                running -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def failure(error: BaseException) -> APIError:
    """The answer to a request whose generation failed after it was accepted."""
    if isinstance(error, APIError):
        return error
    return APIError("The engine died while generating this response.", 503, code="engine_dead")


async def sse_events(
    streams: list[RequestStream],
    timer: RequestTimer,
    deadline: float | None,
    base: dict,
    req: CompletionRequest | ChatCompletionRequest,
    want_logprobs: bool,
    choice: Callable[[RequestOutput, int], dict],
    first_choice: Callable[[int], dict] | None = None,
) -> AsyncIterator[str]:
    """SSE events of one streamed request: per choice, a chunk per output that carries text (or
    logprobs), with the choice's index, the finish reason on its last one; then the usage chunk
    (the prompt once, every choice's tokens) if asked for."""

    def chunk(choices: list[dict], usage_value: dict | None) -> str:
        body = dict(base, choices=choices)
        if req.include_usage or req.continuous_usage:
            body["usage"] = usage_value
        return f"data: {dump_json(body)}\n\n"

    if first_choice is not None:
        for i in range(len(streams)):
            yield chunk([first_choice(i)], None)
    tokens = [0] * len(streams)
    prompt_tokens = 0
    async for i, out in merged_outputs(streams, timer, deadline):
        c = out.outputs[0]
        tokens[i], prompt_tokens = len(c.token_ids), len(out.prompt_token_ids)
        if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
            continue
        ch = choice(out, i)
        ch["finish_reason"] = c.finish_reason if out.finished else None
        ch["stop_reason"] = c.stop_reason if out.finished else None
        yield chunk([ch], usage(prompt_tokens, sum(tokens)) if req.continuous_usage else None)
    if req.include_usage:
        yield chunk([], usage(prompt_tokens, sum(tokens)))


def sse_response(request: Request, events: AsyncIterator[str]) -> StreamingResponse:
    log = request.state.log
    log["stream"] = True

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineDeadError, APIError) as e:
            err = failure(e)
            logger.warning("stream of request %s ended early: %s", request.state.request_id, err.code)
            log["error"] = error_kind(err.status_code, err.code)
            yield f"data: {dump_json(err.body())}\n\n"
        except Exception:  # a bug: the traceback goes to the log, the client gets a clean end
            logger.exception("stream of request %s failed", request.state.request_id)
            log["error"] = "internal_error"
            yield f"data: {dump_json(APIError('Internal server error.', 500, code='internal_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def collect_final(request: Request, streams: list[RequestStream], timer: RequestTimer,
                        deadline: float | None) -> list[RequestOutput] | None:
    """Wait for every choice's final output, in choice order; None (request aborted) if the
    client disconnects first."""

    async def run() -> list[RequestOutput] | None:
        final: dict[int, RequestOutput] = {}
        async for i, out in merged_outputs(streams, timer, deadline):
            final[i] = out
        return [final[i] for i in range(len(streams))] if len(final) == len(streams) else None

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        watcher.cancel()
        for stream in streams:
            stream.close()
        task.cancel()
        raise
    watcher.cancel()
    if not task.done():  # the client is gone: abort
        for stream in streams:
            stream.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("client disconnected; aborted request %s", streams[0].request_id)
        request.state.log["error"] = error_kind(499)
        return None
    try:
        final = task.result()
    except (EngineDeadError, APIError) as e:
        raise failure(e) from None
    if final is None:
        raise APIError("The request ended without output.", 500)
    return final
