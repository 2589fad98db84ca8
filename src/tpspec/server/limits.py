"""What one request may ask of the server, checked before the engine sees it.

Every limit breached is a 4xx whose message names the limit and the server flag that sets it:
body size (413), content type (415), a body that arrives too slowly (408), prompt tokens,
``max_tokens``, stop strings and stop token ids (400, code ``limit_exceeded``). ``n`` is limited
to 1 by the protocol itself. The per-request timeout (``request_timeout_s``) bounds a request from
its arrival to its last token; the bound on waiting requests belongs to the engine front
(``AsyncEngine(max_waiting_requests=...)``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from tpspec.server.protocol import APIError

# A body that has not fully arrived after this long (or the request timeout, if shorter) is a 408.
BODY_READ_TIMEOUT_S = 60.0


def _check_int(name: str, value: Any, lowest: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        allowed = f"an integer >= {lowest}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of one server (``tpspec serve`` flags in brackets)."""

    max_request_body_bytes: int = 4 * 1024 * 1024  # --max-request-body-bytes
    max_prompt_tokens: int | None = None  # --max-prompt-tokens; None: max_model_len - 1
    max_output_tokens: int | None = None  # --max-output-tokens; None: whatever the context leaves
    max_stop_strings: int = 16  # --max-stop-strings
    max_stop_string_length: int = 256  # --max-stop-string-length (characters)
    max_stop_token_ids: int = 64  # --max-stop-token-ids
    request_timeout_s: float | None = None  # --request-timeout; None: no deadline

    def __post_init__(self) -> None:
        _check_int("max_request_body_bytes", self.max_request_body_bytes, 1)
        _check_int("max_prompt_tokens", self.max_prompt_tokens, 1, allow_none=True)
        _check_int("max_output_tokens", self.max_output_tokens, 1, allow_none=True)
        _check_int("max_stop_strings", self.max_stop_strings, 0)
        _check_int("max_stop_string_length", self.max_stop_string_length, 1)
        _check_int("max_stop_token_ids", self.max_stop_token_ids, 0)
        t = self.request_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
            raise ValueError(f"request_timeout_s must be a finite number of seconds > 0 or None, got {t!r}")

    def deadline(self) -> float | None:
        """The ``time.monotonic()`` by which a request arriving now must be done."""
        return None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s

    def check_stops(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop_strings:
            raise _limit(f"stop has {len(stops)} strings; this server allows at most {self.max_stop_strings} "
                         "(--max-stop-strings)", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_string_length:
            raise _limit(f"a stop string is {longest} characters long; this server allows at most "
                         f"{self.max_stop_string_length} (--max-stop-string-length)", "stop")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise _limit(f"stop_token_ids has {len(stop_token_ids)} ids; this server allows at most "
                         f"{self.max_stop_token_ids} (--max-stop-token-ids)", "stop_token_ids")

    def check_prompt(self, num_tokens: int, param: str) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise _limit(f"the prompt has {num_tokens} tokens; this server allows at most {self.max_prompt_tokens} "
                         "(--max-prompt-tokens)", param)

    def cap_output(self, requested: int | None, default: int | None, param: str) -> tuple[int | None, int | None]:
        """(requested, default) max_tokens after the server's cap: asking for more is a 400, the
        default shrinks to the cap."""
        cap = self.max_output_tokens
        if cap is None:
            return requested, default
        if requested is not None and requested > cap:
            raise _limit(f"{param} is {requested}; this server allows at most {cap} (--max-output-tokens)", param)
        return requested, cap if default is None else min(default, cap)

    async def read_json(self, request: Request, deadline: float | None) -> Any:
        """The request body parsed as JSON, within the size limit and in time."""
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type and content_type != "application/json" and not content_type.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {content_type[:64]!r}", 415,
                           code="unsupported_media_type")
        limit = self.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        timeout = BODY_READ_TIMEOUT_S if deadline is None else min(BODY_READ_TIMEOUT_S, deadline - time.monotonic())
        try:
            body = await asyncio.wait_for(_read_body(request, limit), max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise APIError(f"The request body did not arrive within {timeout:.3g} s.", 408, code="request_timeout") from None
        except ClientDisconnect:
            raise APIError("The client closed the connection while sending the body.", 499, code="client_disconnected") from None
        try:
            return json.loads(body)
        except RecursionError:
            raise APIError("The request body is nested too deeply.", code="invalid_json") from None
        except ValueError:  # JSONDecodeError, bad UTF-8, an integer with too many digits
            raise APIError("The request body is not valid JSON.", code="invalid_json") from None


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-body-bytes).", 413, code="request_too_large")


def _limit(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param, code="limit_exceeded")
