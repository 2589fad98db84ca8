"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an ``AsyncEngine``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as SSE or
not), ``GET /v1/models``, ``/health`` (200, or 503 once the engine died), ``/version``,
``/metrics`` (Prometheus). Errors are OpenAI-shaped ``{"error": {message, type, param, code}}``
with a 4xx for anything the client got wrong (validation errors are 400, as in vLLM), never a
stack trace. With an API key every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
CORS is off unless origins are allowed explicitly.

Per-request limits are in ``limits``; a full engine queue is a 429 with Retry-After; a request
past its deadline ends with 504 ``request_timeout``. A failure after a stream has started arrives
as a last ``data: {"error": ...}`` event before ``[DONE]``. A client that goes away, mid-stream
or while waiting for a non-streamed answer, aborts its request (its KV blocks are freed at once).
Request ids, request logs and error counters: ``middleware``; ``tpspec serve`` and shutdown: ``lifecycle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tpspec
from tpspec.distributed.executor import EngineDeadError
from tpspec.engine.async_engine import AsyncEngine, EngineOverloadedError, RequestStream
from tpspec.engine.outputs import RequestOutput
from tpspec.sampling_params import SamplingParams
from tpspec.server.limits import ServerLimits
from tpspec.server.metrics import CONTENT_TYPE, ServerMetrics
from tpspec.server.middleware import APIKeyMiddleware, RequestContextMiddleware, error_kind, record_error
from tpspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    finite_logprob,
    new_id,
    now,
    usage,
    validation_error_to_api_error,
)

logger = logging.getLogger(__name__)

# Seconds a client is asked to wait (Retry-After) when the queue is full or the server is stopping.
RETRY_AFTER_S = 1


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_response(request: Request, err: APIError) -> JSONResponse:
    record_error(request.scope.get("state", {}), err.status_code, err.code)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


class _RequestTimer:
    """Arrival, first token and end of one request, for the latency histograms and the request log."""

    def __init__(self, metrics: ServerMetrics, log: dict) -> None:
        self.metrics = metrics
        self.log = log
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if self.first_token is None and out.new_token_ids:
            self.first_token = time.monotonic()
        if out.finished and not self.done:
            self.done = True
            latency = time.monotonic() - self.arrival
            ttft = None if self.first_token is None else self.first_token - self.arrival
            c = out.outputs[0]
            self.metrics.observe_request(ttft, latency, len(c.token_ids), c.finish_reason)
            self.log.update(completion_tokens=len(c.token_ids), finish_reason=c.finish_reason)

    def on_gone(self, reason: str = "abort") -> None:
        """The request ended without a finished output (client gone, engine error, deadline)."""
        if not self.done:
            self.done = True
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
            self.log["finish_reason"] = reason


class OpenAIServer:
    """Request handling, independent of how the app is run."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], model_path: str | None = None,
                 limits: ServerLimits | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.model_path = model_path
        self.limits = limits or ServerLimits()
        self.metrics = ServerMetrics(self.model_name)
        self.created = now()
        self.draining = False  # shutting down: no new requests (set by lifecycle.GracefulServer)

    # ---- shared steps ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(f"The model '{model}' does not exist; this server serves {self.names}.", 404,
                           param="model", code="model_not_found")

    def check_engine(self) -> None:
        if self.draining:
            raise APIError("The server is shutting down.", 503, code="server_shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if not self.engine.is_healthy:
            raise APIError("The engine is not running (it died or is shutting down).", 503, code="engine_dead")

    def resolve_max_tokens(self, requested: int | None, default: int | None, prompt_len: int,
                           param: str, prompt_param: str) -> int | None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
                param=prompt_param, code="context_length_exceeded",
            )
        room = limit - prompt_len
        if requested is None:
            return None if default is None else min(default, room)
        if requested > room:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded",
            )
        return requested

    @staticmethod
    def check_max_tokens_sign(value: int | None, param: str) -> None:
        if value is not None and value < 1:
            raise APIError(f"{param} must be at least 1, got {value}", param=param, code="invalid_value")

    def tokenize(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:  # JSON may spell a lone surrogate (\ud800); no tokenizer takes one
                raise APIError(f"{param} is not valid Unicode text: it holds an unpaired surrogate", param=param) from None
            ids = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(f"{param} is empty: it must contain at least one token", param=param)
        return ids

    async def start(self, ids: list[int], params: SamplingParams, request_id: str, request: Request) -> RequestStream:
        self.check_engine()
        request.state.log.update(completion_id=request_id, prompt_tokens=len(ids))
        try:
            return await self.engine.add_request(ids, params, request_id)
        except ValueError as e:
            raise APIError(str(e)) from None
        except EngineOverloadedError:
            raise APIError(f"The server is busy: {self.engine.max_requests} requests are already running or waiting. "
                           "Retry later.", 429, code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError:
            raise APIError("The engine is not running (it died or is shutting down).", 503, code="engine_dead") from None

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- logprobs -------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(finite_logprob(entry.get(tid, float("-inf"))))
            top: dict[str, float] = {}
            for t, lp in sorted(entry.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.token_text(t), finite_logprob(lp))  # ids that decode alike: keep the best
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            text = self.token_text(tid)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({
                "token": text,
                "logprob": finite_logprob(entry.get(tid, float("-inf"))),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (s := self.token_text(t)), "logprob": finite_logprob(lp), "bytes": list(s.encode("utf-8"))}
                    for t, lp in ranked
                ],
            })
        return {"content": content}

    # ---- endpoints ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        deadline = self.limits.deadline()
        req = _validate(CompletionRequest, await self.limits.read_json(request, deadline))
        self.check_model(req.model)
        self.check_max_tokens_sign(req.max_tokens, "max_tokens")
        self.limits.check_stops(req.stop, req.stop_token_ids)
        requested, default = self.limits.cap_output(req.max_tokens, 16, "max_tokens")
        prompt = req.single_prompt()
        params = req.to_sampling_params(requested)
        ids = self.tokenize(prompt, "prompt")
        self.limits.check_prompt(len(ids), "prompt")
        max_tokens = self.resolve_max_tokens(requested, default, len(ids), "max_tokens", "prompt")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("cmpl")
        timer = _RequestTimer(self.metrics, request.state.log)
        stream = await self.start(ids, params, request_id, request)
        base = {"id": request_id, "object": "text_completion", "created": now(), "model": self.model_name}
        want_logprobs = params.logprobs is not None

        if req.stream:
            text_offset = 0

            def choice(out: RequestOutput) -> dict:
                nonlocal text_offset
                c, lp = out.outputs[0], None
                if want_logprobs:
                    start = len(c.token_ids) - len(out.new_token_ids)
                    lp = self.completion_logprobs(out.new_token_ids, (c.logprobs or [])[start:], text_offset)
                    text_offset += sum(len(t) for t in lp["tokens"])
                return {"index": 0, "text": out.new_text, "logprobs": lp}

            return _sse(request, _events(stream, timer, deadline, base, req, want_logprobs, choice))

        final = await _collect(request, stream, timer, deadline)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        lp = self.completion_logprobs(c.token_ids, c.logprobs or [], 0) if want_logprobs else None
        choice = {"index": 0, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return JSONResponse(dict(base, choices=[choice], usage=usage(len(final.prompt_token_ids), len(c.token_ids))))

    async def chat_completions(self, request: Request) -> Response:
        deadline = self.limits.deadline()
        req = _validate(ChatCompletionRequest, await self.limits.read_json(request, deadline))
        self.check_model(req.model)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.requested_max_tokens()
        self.check_max_tokens_sign(requested, param)
        self.limits.check_stops(req.stop, req.stop_token_ids)
        requested, default = self.limits.cap_output(requested, None, param)
        params = req.to_sampling_params(requested)
        messages = [m.as_template_input(i) for i, m in enumerate(req.messages)]
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        ids = self.tokenize(text, "messages", add_special_tokens=False)
        self.limits.check_prompt(len(ids), "messages")
        max_tokens = self.resolve_max_tokens(requested, default, len(ids), param, "messages")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("chatcmpl")
        timer = _RequestTimer(self.metrics, request.state.log)
        stream = await self.start(ids, params, request_id, request)
        base = {"id": request_id, "object": "chat.completion", "created": now(), "model": self.model_name}
        top_n = req.top_logprobs or 0
        want_logprobs = params.logprobs is not None

        if req.stream:
            base["object"] = "chat.completion.chunk"
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

            def choice(out: RequestOutput) -> dict:
                c, lp = out.outputs[0], None
                if want_logprobs:
                    start = len(c.token_ids) - len(out.new_token_ids)
                    lp = self.chat_logprobs(out.new_token_ids, (c.logprobs or [])[start:], top_n)
                delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
                return {"index": 0, "delta": delta, "logprobs": lp}

            return _sse(request, _events(stream, timer, deadline, base, req, want_logprobs, choice, first))

        final = await _collect(request, stream, timer, deadline)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        lp = self.chat_logprobs(c.token_ids, c.logprobs or [], top_n) if want_logprobs else None
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return JSONResponse(dict(base, choices=[choice], usage=usage(len(final.prompt_token_ids), len(c.token_ids))))

    def models(self) -> dict:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "tpspec",
             "root": self.model_path or self.names[0], "parent": None, "max_model_len": self.engine.max_model_len}
            for name in self.names
        ]
        return {"object": "list", "data": data}

    async def render_metrics(self) -> bytes:
        self.metrics.update_engine_stats(await self.engine.get_stats())
        return self.metrics.render()


def _validate(model_cls, body: Any):
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None
    if req.model_extra:
        logger.debug("ignoring unsupported request fields %s", sorted(req.model_extra))
    return req


async def _iterate(stream: RequestStream, timer: _RequestTimer, deadline: float | None) -> AsyncIterator[RequestOutput]:
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
        timer.on_gone("abort")


def _failure(error: BaseException) -> APIError:
    """The answer to a request whose generation failed after it was accepted."""
    if isinstance(error, APIError):
        return error
    return APIError("The engine died while generating this response.", 503, code="engine_dead")


async def _events(
    stream: RequestStream,
    timer: _RequestTimer,
    deadline: float | None,
    base: dict,
    req: CompletionRequest | ChatCompletionRequest,
    want_logprobs: bool,
    choice: Callable[[RequestOutput], dict],
    first_choice: dict | None = None,
) -> AsyncIterator[str]:
    """SSE events of one streamed request: a chunk per output that carries text (or logprobs),
    the finish reason on the last one, then the usage chunk if asked for."""

    def chunk(choices: list[dict], usage_value: dict | None) -> str:
        body = dict(base, choices=choices)
        if req.include_usage or req.continuous_usage:
            body["usage"] = usage_value
        return f"data: {_json(body)}\n\n"

    if first_choice is not None:
        yield chunk([first_choice], None)
    async for out in _iterate(stream, timer, deadline):
        if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
            continue
        c = out.outputs[0]
        counts = usage(len(out.prompt_token_ids), len(c.token_ids))
        ch = choice(out)
        ch["finish_reason"] = c.finish_reason if out.finished else None
        ch["stop_reason"] = c.stop_reason if out.finished else None
        yield chunk([ch], counts if req.continuous_usage else None)
        if out.finished and req.include_usage:
            yield chunk([], counts)


def _sse(request: Request, events: AsyncIterator[str]) -> StreamingResponse:
    log = request.state.log
    log["stream"] = True

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except (EngineDeadError, APIError) as e:
            err = _failure(e)
            logger.warning("stream of request %s ended early: %s", request.state.request_id, err.code)
            log["error"] = error_kind(err.status_code, err.code)
            yield f"data: {_json(err.body())}\n\n"
        except Exception:  # a bug: the traceback goes to the log, the client gets a clean end
            logger.exception("stream of request %s failed", request.state.request_id)
            log["error"] = "internal_error"
            yield f"data: {_json(APIError('Internal server error.', 500, code='internal_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(request: Request, stream: RequestStream, timer: _RequestTimer,
                   deadline: float | None) -> RequestOutput | None:
    """Wait for the final output; None (request aborted) if the client disconnects first."""

    async def run() -> RequestOutput | None:
        final = None
        async for out in _iterate(stream, timer, deadline):
            final = out
        return final

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
        stream.close()
        task.cancel()
        raise
    watcher.cancel()
    if not task.done():  # the client is gone: abort
        stream.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("client disconnected; aborted request %s", stream.request_id)
        request.state.log["error"] = error_kind(499)
        return None
    try:
        final = task.result()
    except (EngineDeadError, APIError) as e:
        raise _failure(e) from None
    if final is None:
        raise APIError("The request ended without output.", 500)
    return final


def build_app(
    engine: AsyncEngine,
    served_model_names: list[str],
    api_key: str | None = None,
    model_path: str | None = None,
    limits: ServerLimits | None = None,
    allowed_origins: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app over a started ``engine``. The caller owns the engine's lifetime.

    ``allowed_origins`` turns CORS on for those origins (``["*"]``: any); None leaves it off."""
    server = OpenAIServer(engine, served_model_names, model_path, limits)
    app = FastAPI(title="tpspec", version=tpspec.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, APIError("Invalid request.", 400))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = exc.status_code
        message = {404: "Not found.", 405: "Method not allowed."}.get(code, "HTTP error.")
        return _error_response(request, APIError(message, code, headers=getattr(exc, "headers", None)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health(request: Request) -> Response:
        if engine.is_healthy and not server.draining:
            return Response(status_code=200)
        code = "server_shutting_down" if engine.is_healthy else "engine_dead"
        return _error_response(request, APIError("The engine is not running.", 503, code=code))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": tpspec.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.render_metrics(), media_type=CONTENT_TYPE)

    # The last added runs first: request context, then CORS (preflights need no key), then the key.
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id", "Retry-After"])
    app.add_middleware(RequestContextMiddleware, metrics=server.metrics)
    return app
