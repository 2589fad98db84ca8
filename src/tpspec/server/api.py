"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an ``AsyncEngine``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as SSE or
not), ``GET /v1/models``, ``/health`` (200, or 503 once the engine died), ``/version``,
``/metrics`` (Prometheus). Errors are OpenAI-shaped ``{"error": {message, type, param, code}}``
with a 4xx for anything the client got wrong (validation errors are 400, as in vLLM), never a
stack trace. With an API key every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.

A client that goes away, mid-stream or while waiting for a non-streamed answer, aborts its request
(its KV blocks are freed at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tpspec
from tpspec.distributed.executor import EngineDeadError
from tpspec.engine.async_engine import AsyncEngine, RequestStream
from tpspec.engine.outputs import RequestOutput
from tpspec.sampling_params import SamplingParams
from tpspec.server.args import API_KEY_ENV
from tpspec.server.metrics import CONTENT_TYPE, ServerMetrics
from tpspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    finite_logprob,
    new_id,
    now,
    usage,
    validation_error_to_api_error,
)

logger = logging.getLogger(__name__)

def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


class _APIKeyMiddleware:
    """Pure ASGI (so streaming and disconnect detection are untouched): 401 without the key."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            response = JSONResponse(
                error_body("Incorrect or missing API key (send 'Authorization: Bearer <key>').", 401, code="invalid_api_key"),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _RequestTimer:
    """Arrival, first token and end of one request, for the latency histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
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

    def on_gone(self, reason: str = "abort") -> None:
        """The request ended without a finished output (client gone, engine error)."""
        if not self.done:
            self.done = True
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()


class OpenAIServer:
    """Request handling, independent of how the app is run."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], model_path: str | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.engine = engine
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.model_path = model_path
        self.metrics = ServerMetrics(self.model_name)
        self.created = now()

    # ---- shared steps ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(f"The model '{model}' does not exist; this server serves {self.names}.", 404,
                           param="model", code="model_not_found")

    def check_engine(self) -> None:
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

    def tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(f"{param} is empty: it must contain at least one token", param=param)
        return ids

    async def start(self, ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        self.check_engine()
        try:
            return await self.engine.add_request(ids, params, request_id)
        except ValueError as e:
            raise APIError(str(e)) from None
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
    async def completions(self, body: Any, request: Request) -> Response:
        req = _validate(CompletionRequest, body)
        self.check_model(req.model)
        self.check_max_tokens_sign(req.max_tokens, "max_tokens")
        prompt = req.single_prompt()
        params = req.to_sampling_params(req.max_tokens)
        ids = self.tokenize(prompt, "prompt")
        max_tokens = self.resolve_max_tokens(req.max_tokens, 16, len(ids), "max_tokens", "prompt")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("cmpl")
        timer = _RequestTimer(self.metrics)
        stream = await self.start(ids, params, request_id)
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

            return _sse(_events(stream, timer, base, req, want_logprobs, choice))

        final = await _collect(request, stream, timer)
        if final is None:
            return Response(status_code=499)
        c = final.outputs[0]
        lp = self.completion_logprobs(c.token_ids, c.logprobs or [], 0) if want_logprobs else None
        choice = {"index": 0, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return JSONResponse(dict(base, choices=[choice], usage=usage(len(final.prompt_token_ids), len(c.token_ids))))

    async def chat_completions(self, body: Any, request: Request) -> Response:
        req = _validate(ChatCompletionRequest, body)
        self.check_model(req.model)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.requested_max_tokens()
        self.check_max_tokens_sign(requested, param)
        params = req.to_sampling_params(requested)
        messages = [m.as_template_input(i) for i, m in enumerate(req.messages)]
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        ids = self.tokenize(tok.encode(text, add_special_tokens=False), "messages")
        max_tokens = self.resolve_max_tokens(requested, None, len(ids), param, "messages")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("chatcmpl")
        timer = _RequestTimer(self.metrics)
        stream = await self.start(ids, params, request_id)
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

            return _sse(_events(stream, timer, base, req, want_logprobs, choice, first))

        final = await _collect(request, stream, timer)
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


async def _iterate(stream: RequestStream, timer: _RequestTimer) -> AsyncIterator[RequestOutput]:
    """The request's outputs, with timing; closing early (client gone) aborts the request."""
    try:
        async for out in stream:
            timer.on_output(out)
            yield out
    except EngineDeadError:
        timer.on_gone("error")
        raise
    finally:
        stream.close()
        timer.on_gone("abort")


async def _events(
    stream: RequestStream,
    timer: _RequestTimer,
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
    async for out in _iterate(stream, timer):
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


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError:
            logger.error("the engine died while streaming a response")
            yield f"data: {_json(error_body('The engine died while generating this response.', 503, code='engine_dead'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(request: Request, stream: RequestStream, timer: _RequestTimer) -> RequestOutput | None:
    """Wait for the final output; None (request aborted) if the client disconnects first."""

    async def run() -> RequestOutput | None:
        final = None
        async for out in _iterate(stream, timer):
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
        return None
    try:
        final = task.result()
    except EngineDeadError:
        raise APIError("The engine died while generating this response.", 503, code="engine_dead") from None
    if final is None:
        raise APIError("The request ended without output.", 500)
    return final


async def _read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("The request body is not valid JSON.", code="invalid_json") from None


def build_app(
    engine: AsyncEngine,
    served_model_names: list[str],
    api_key: str | None = None,
    model_path: str | None = None,
) -> FastAPI:
    """The FastAPI app over a started ``engine``. The caller owns the engine's lifetime."""
    server = OpenAIServer(engine, served_model_names, model_path)
    app = FastAPI(title="tpspec", version=tpspec.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body("Invalid request.", 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = exc.status_code
        message = {404: "Not found.", 405: "Method not allowed."}.get(code, str(exc.detail))
        return JSONResponse(error_body(message, code), status_code=code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body("Internal server error.", 500), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(await _read_json(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(await _read_json(request), request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(error_body("The engine is not running.", 503, code="engine_dead"), status_code=503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": tpspec.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.render_metrics(), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


# ---- `tpspec serve` -------------------------------------------------------------------------------
def run_server(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """Build the engine (on its own thread), then serve until SIGINT/SIGTERM."""
    import uvicorn

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice and differently: {args.model_tag!r} and --model {args.model!r}")
        engine_args["model"] = args.model_tag
    if args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: tpspec runs no code from model folders")
    if args.gpu_memory_utilization is not None:
        logger.info("--gpu-memory-utilization is ignored: size the KV cache with --kv-cache-memory-gb or --num-kv-blocks")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    model = engine_args.get("model")
    if args.served_model_name:
        names = args.served_model_name
    elif model is not None:
        names = [model]
    else:
        from tpspec.default_model import DEFAULT_MODEL_FILE

        names = [DEFAULT_MODEL_FILE.split(".")[0]]

    engine = AsyncEngine.from_args(**engine_args)
    try:
        app = build_app(engine, names, api_key=api_key, model_path=model)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5)
        sock = config.bind_socket()
        host, port = sock.getsockname()[:2]
        logger.info("tpspec server ready: http://%s:%d (model %s%s)", host, port, names[0],
                    ", API key required" if api_key else "")
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler it found: make
        # that a no-op so the engine below is shut down too and the exit status is 0.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.shutdown()
    return 0
