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

import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tpspec
from tpspec.executor.executor import EngineDeadError
from tpspec.engine.async_engine import AsyncEngine, EngineOverloadedError, RequestStream
from tpspec.engine.outputs import RequestOutput
from tpspec.engine.prompt_checks import PromptError, check_prompt
from tpspec.sampling_params import SamplingParams, default_of
from tpspec.server.limits import ServerLimits
from tpspec.server.metrics import CONTENT_TYPE, ServerMetrics
from tpspec.server.middleware import APIKeyMiddleware, RequestContextMiddleware, record_error
from tpspec.server.streaming import RequestTimer, collect_final, sse_events, sse_response
from tpspec.structured.grammar import GrammarError
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


def _error_response(request: Request, err: APIError) -> JSONResponse:
    record_error(request.scope.get("state", {}), err.status_code, err.code)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


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

    def resolve_max_tokens(self, requested: int | None, default: int | None, prompt_len: int, param: str) -> int | None:
        """The request's max_tokens within the context the prompt leaves (``check_prompt`` made sure it leaves some)."""
        limit = self.engine.max_model_len
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
        """The prompt's token ids, checked as the engine checks them (``engine.prompt_checks``)."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:  # JSON may spell a lone surrogate (\ud800); no tokenizer takes one
                raise APIError(f"{param} is not valid Unicode text: it holds an unpaired surrogate", param=param) from None
            prompt = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        try:
            return check_prompt(prompt, self.engine.vocab_size, self.engine.max_model_len, param)
        except PromptError as e:
            raise APIError(str(e), param=e.param, code=e.code) from None

    async def start(
        self, ids: list[int], params: SamplingParams, request_id: str, request: Request,
        constraint_param: str | None = None,
    ) -> list[RequestStream]:
        """Hand the request to the engine, one engine request per choice (``params.n``; the first
        computes the prompt, the others take its blocks); ``constraint_param``: the request field
        holding its structured-output constraint, which a grammar the engine rejects is reported
        against. Returns the choices' streams, in order; if one is refused, none runs."""
        self.check_engine()
        request.state.log.update(completion_id=request_id, prompt_tokens=len(ids))
        streams: list[RequestStream] = []
        try:
            for i, choice in enumerate(params.choices()):
                engine_id = request_id if params.n == 1 else f"{request_id}-{i}"
                after = streams[0].request_id if streams else None
                streams.append(await self._add(ids, choice, engine_id, after, constraint_param))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _add(self, ids: list[int], params: SamplingParams, request_id: str, after: str | None,
                   constraint_param: str | None) -> RequestStream:
        try:
            return await self.engine.add_request(ids, params, request_id, after)
        except GrammarError as e:
            raise APIError(str(e), param=constraint_param) from None
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
        requested, default = self.limits.cap_output(req.max_tokens, default_of("max_tokens"), "max_tokens")
        prompt = req.single_prompt()
        params = req.to_sampling_params(requested)
        ids = self.tokenize(prompt, "prompt")
        self.limits.check_prompt(len(ids), "prompt")
        max_tokens = self.resolve_max_tokens(requested, default, len(ids), "max_tokens")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("cmpl")
        timer = RequestTimer(self.metrics, request.state.log, params.n)
        streams = await self.start(ids, params, request_id, request, req.constraint_param)
        base = {"id": request_id, "object": "text_completion", "created": now(), "model": self.model_name}
        want_logprobs = params.logprobs is not None

        if req.stream:
            text_offset = [0] * params.n  # per choice

            def choice(out: RequestOutput, index: int) -> dict:
                c, lp = out.outputs[0], None
                if want_logprobs:
                    start = len(c.token_ids) - len(out.new_token_ids)
                    lp = self.completion_logprobs(out.new_token_ids, (c.logprobs or [])[start:], text_offset[index])
                    text_offset[index] += sum(len(t) for t in lp["tokens"])
                return {"index": index, "text": out.new_text, "logprobs": lp}

            return sse_response(request, sse_events(streams, timer, deadline, base, req, want_logprobs, choice))

        finals = await collect_final(request, streams, timer, deadline)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, final in enumerate(finals):
            c = final.outputs[0]
            lp = self.completion_logprobs(c.token_ids, c.logprobs or [], 0) if want_logprobs else None
            choices.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        return JSONResponse(dict(base, choices=choices, usage=self.usage_of(finals)))

    @staticmethod
    def usage_of(finals: list[RequestOutput]) -> dict[str, int]:
        """Token counts of a request: its prompt once, every choice's output."""
        return usage(len(finals[0].prompt_token_ids), sum(len(f.outputs[0].token_ids) for f in finals))

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
        max_tokens = self.resolve_max_tokens(requested, default, len(ids), param)
        params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = new_id("chatcmpl")
        timer = RequestTimer(self.metrics, request.state.log, params.n)
        streams = await self.start(ids, params, request_id, request, req.constraint_param)
        base = {"id": request_id, "object": "chat.completion", "created": now(), "model": self.model_name}
        top_n = req.top_logprobs or 0
        want_logprobs = params.logprobs is not None

        if req.stream:
            base["object"] = "chat.completion.chunk"

            def first(index: int) -> dict:
                return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}

            def choice(out: RequestOutput, index: int) -> dict:
                c, lp = out.outputs[0], None
                if want_logprobs:
                    start = len(c.token_ids) - len(out.new_token_ids)
                    lp = self.chat_logprobs(out.new_token_ids, (c.logprobs or [])[start:], top_n)
                delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
                return {"index": index, "delta": delta, "logprobs": lp}

            return sse_response(request, sse_events(streams, timer, deadline, base, req, want_logprobs, choice, first))

        finals = await collect_final(request, streams, timer, deadline)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, final in enumerate(finals):
            c = final.outputs[0]
            lp = self.chat_logprobs(c.token_ids, c.logprobs or [], top_n) if want_logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse(dict(base, choices=choices, usage=self.usage_of(finals)))

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
