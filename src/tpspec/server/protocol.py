"""OpenAI request schemas (pydantic), their translation to ``SamplingParams``, and error bodies.

Requests are validated strictly (``"max_tokens": "5"`` or ``"stream": "yes"`` is a 400, not a
silent coercion). Unknown fields are ignored, as the OpenAI API and vLLM do. Besides the OpenAI
fields, vLLM's sampling extras are accepted: ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tpspec.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, default_of


class APIError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _error_type(status_code)
        self.headers = headers  # extra response headers, e.g. Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param, self.code, self.type)


def _error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, status_code: int, param: str | None = None, code: str | None = None, type: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _error_type(status_code), "param": param, "code": code}}


def validation_error_to_api_error(error: ValidationError) -> APIError:
    """A 400 naming the offending field(s), without echoing the input or any internals."""
    by_field: dict[str, str] = {}
    for e in error.errors(include_url=False, include_input=False):
        loc = [str(p) for p in e.get("loc", ())]
        # Drop union-member tags pydantic adds to the location (e.g. 'list[int]', 'str').
        loc = [p for p in loc if not (p in _TYPE_TAGS or "[" in p or p.startswith("function-"))]
        field = ".".join(loc) or "body"
        if field not in by_field:
            by_field[field] = e.get("msg", "invalid value")
        elif e.get("type", "").endswith("_type"):
            by_field[field] = "has the wrong type"
    first = next(iter(by_field))
    message = "; ".join(f"{field}: {msg}" for field, msg in by_field.items())
    return APIError(message, 400, param=None if first == "body" else first)


_INT64_MAX = 2**63 - 1

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tagged-union", "literal", "model"}


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Base):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _constraints(self) -> dict[str, dict[str, Any]]:
        """The request fields that constrain the output, each as ``StructuredOutputsParams`` fields."""
        found: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError("response_format.json_schema must be an object with a JSON schema in 'schema'",
                                   param="response_format.json_schema")
                found["response_format"] = {"json": spec["schema"]}
            elif kind != "text":
                raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                               param="response_format.type")
        if self.structured_outputs is not None:
            found["structured_outputs"] = dict(self.structured_outputs)
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found[f"guided_{name}"] = {name: value}
        return found

    @property
    def constraint_param(self) -> str | None:
        """The request field that holds the output's constraint (named in a grammar error)."""
        return next(iter(self._constraints()), None)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        found = self._constraints()
        if len(found) > 1:
            raise APIError(f"only one of {sorted(found)} may constrain the output", param=sorted(found)[1])
        if not found:
            return None
        (param, fields), = found.items()
        try:
            return StructuredOutputsParams.from_dict(fields)
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported (must be 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        # The sampler packs top_k into an int64 tensor: a larger value would fail the engine step.
        if self.top_k is not None and not -1 <= self.top_k <= _INT64_MAX:
            raise APIError(f"top_k must be -1, 0 or in [1, {_INT64_MAX}], got {self.top_k}", param="top_k")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # Fields the request leaves out (null) take SamplingParams' defaults, which are vLLM's.
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        skip_special_tokens=self.skip_special_tokens)
        kwargs: dict[str, Any] = dict(
            {k: v for k, v in optional.items() if v is not None},
            n=1 if self.n is None else self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            structured_outputs=self._structured_outputs(),
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:  # the message names the field, the bad value and what is allowed
            message = str(e)
            field = message.split(" ", 1)[0]
            raise APIError(message, param=field if field in kwargs else None) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = default_of("max_tokens")  # the OpenAI API's 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of several is a 400)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(
                    f"batched prompts are not supported: send one prompt per request (got {len(p)})", param="prompt"
                )
            p = p[0]
        if isinstance(p, list) and not p:
            raise APIError("prompt is empty", param="prompt")
        return p

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._check_unsupported()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(f"best_of must be 1, got {self.best_of}", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        return self._sampling_params(max_tokens, self.logprobs)


class ChatMessage(_Base):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{index}].content: only text parts are supported", param=f"messages.{index}.content"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        message: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool | None = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._check_unsupported()
        if self.tools and self.tool_choice != "none":
            raise APIError("tools are not supported", param="tools")
        logprobs = None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
                )
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        return self._sampling_params(max_tokens, logprobs)


# ---- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finite_logprob(value: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    if math.isnan(value):
        return -9999.0
    return max(float(value), -9999.0)


