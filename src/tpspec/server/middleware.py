"""Pure ASGI middleware (streaming and disconnect detection stay untouched).

``RequestContextMiddleware`` (outermost) gives every HTTP request an id, echoed in the
``X-Request-Id`` response header (the client's own if it sent a plain token, else a new one),
writes one structured (JSON) log line per request when its response has ended, counts errors by
kind on ``/metrics``, and turns anything unhandled into an OpenAI-shaped 500: the traceback goes to
the log, never to the client. ``APIKeyMiddleware`` answers 401 to every request without the key
except ``/health``; the key is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
import uuid

from fastapi.responses import JSONResponse

from tpspec.server.metrics import ServerMetrics
from tpspec.server.protocol import error_body

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("tpspec.server.requests")

REQUEST_ID_HEADER = "x-request-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# Error kinds of statuses answered without an error code of their own.
_STATUS_KINDS = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 499: "client_disconnected"}


def error_kind(status: int, code: str | None = None) -> str:
    """The ``kind`` label an error is counted under: its OpenAI error code, else one by status."""
    if code:
        return code
    return _STATUS_KINDS.get(status, "internal_error" if status >= 500 else f"http_{status}")


def record_error(state: dict, status: int, code: str | None) -> None:
    """Note the error a request ended with (``state`` is the ASGI scope's state)."""
    log = state.get("log")
    if log is not None:
        log["error"] = error_kind(status, code)


class RequestContextMiddleware:
    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_request_id(scope) or uuid.uuid4().hex
        log: dict = {}  # filled in by the handlers: completion id, token counts, finish reason, error
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["log"] = log
        status = 0
        start = time.monotonic()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER.encode(), request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error while serving request %s", request_id)
            log["error"] = "internal_error"
            if status == 0:  # nothing sent yet: answer with a plain 500
                response = JSONResponse(error_body("Internal server error.", 500, code="internal_error"), status_code=500)
                await response(scope, receive, send_with_id)
        finally:
            kind = log.get("error") or (error_kind(status) if status >= 400 else None)
            if kind is not None:
                self.metrics.request_errors.labels(self.metrics.model_name, kind).inc()
            log["error"] = kind
            request_logger.info("%s", json.dumps({
                "request_id": request_id, "method": scope.get("method"), "path": scope.get("path"),
                "status": status, "duration_ms": round((time.monotonic() - start) * 1000, 2), **log,
            }, separators=(",", ":")))


def _client_request_id(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if _CLIENT_ID.fullmatch(text) else None
    return None


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = _digest(f"Bearer {api_key}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        # Equal-length digests: the comparison takes the same time whatever the key's length.
        if not hmac.compare_digest(_digest(given), self.expected):
            response = JSONResponse(
                error_body("Incorrect or missing API key (send 'Authorization: Bearer <key>').", 401, code="invalid_api_key"),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()
