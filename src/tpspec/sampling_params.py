"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

User errors raise ``ValueError`` naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Temperatures in (0, MIN_TEMPERATURE) overflow float32 logits / T; they are raised to this value.
MIN_TEMPERATURE = 1e-2
# Most top logprobs a request may ask for.
MAX_LOGPROBS = 20
# Most choices (``n``) one request may ask for.
MAX_CHOICES = 64


def _check_int(name: str, value: Any, allowed: str, ok: Callable[[int], bool] | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer ({allowed}), got {value!r}")
    if ok is not None and not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _from_mapping(cls, d: Any, not_a_mapping: str, fields: str):
    """``cls(**d)`` for a mapping ``d`` of ``cls``'s field names; ``ValueError`` otherwise, or for an unknown key."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{not_a_mapping}, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ValueError(f"unknown {fields} {unknown}; allowed: {sorted(known)}")
    return cls(**d)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


# The constraint fields of StructuredOutputsParams: exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, shaped like vLLM's ``StructuredOutputsParams``: exactly
    one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the output
    is one of these strings), ``grammar`` (Lark, or llama.cpp's GBNF) and ``json_object`` (any
    JSON object). ``disable_any_whitespace``: JSON with no whitespace between tokens (", " and
    ": " otherwise free whitespace).

    After construction ``json`` is the schema's JSON text and ``choice`` a tuple. Whether the
    grammar engine accepts the constraint is checked when the request is added (``GrammarError``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, got "
                f"{given if given else 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema, got text that is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {c!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {value!r}")

    @property
    def kind(self) -> str:
        """The field that holds the constraint."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StructuredOutputsParams":
        """From a mapping of field names to values (vLLM's request field); unknown keys are an error."""
        return _from_mapping(cls, d, "structured_outputs must be an object", "structured_outputs field(s)")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    After construction ``stop`` and ``stop_token_ids`` are tuples (empty when unset), ``top_k``
    is 0 when disabled (-1 is accepted as an alias) and the numeric fields are plain floats.
    """

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs; 0 = only the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (a JSON schema, regex, ...)

    def __post_init__(self) -> None:
        _check_int("n", self.n, f"1 to {MAX_CHOICES}", lambda v: 1 <= v <= MAX_CHOICES)

        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if 0 < temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %g is below %g and would overflow the logits; using %g",
                temperature, MIN_TEMPERATURE, MIN_TEMPERATURE,
            )
            temperature = MIN_TEMPERATURE
        object.__setattr__(self, "temperature", temperature)

        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "top_p", top_p)

        _check_int("top_k", self.top_k, "0 or -1 (disabled) or in [1, 2**63)", lambda v: -1 <= v < 2**63)
        object.__setattr__(self, "top_k", max(self.top_k, 0))

        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "min_p", min_p)

        if self.seed is not None:
            _check_int("seed", self.seed, "any integer or None")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, ">= 1 or None", lambda v: v >= 1)
        if self.logprobs is not None:
            _check_int(
                "logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None",
                lambda v: 0 <= v <= MAX_LOGPROBS,
            )

        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        so = self.structured_outputs
        if isinstance(so, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, a mapping or None, got {so!r}")

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r} in {stop!r}")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers or None, got {ids!r}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"stop_token_ids must contain integers >= 0, got {i!r} in {ids!r}")
        return tuple(ids)

    def stop_for_token(
        self, token_id: int, eos_token_ids: frozenset[int], num_output_tokens: int, max_tokens: int
    ) -> tuple[str, int | None] | None:
        """Whether an appended output token ends the request, by the token rules that the driver
        and every rank apply alike (stop strings, which need the text, are the driver's): EOS
        (unless ``ignore_eos``), a stop token, or the ``max_tokens``-th output token. Returns
        (finish reason, stop reason): ("stop", None), ("stop", token_id), ("length", None); or None."""
        if not self.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if num_output_tokens >= max_tokens:
            return "length", None
        return None

    def choices(self) -> list["SamplingParams"]:
        """The ``n`` choices of a request as one-sequence requests (``n`` 1 each), as ``LLM`` and the
        server fan them out: choice i is seeded ``seed + i`` when the request is seeded (so a seeded
        request gives the same n choices every time, choice 0 being what ``n = 1`` gives), and
        draws its own seed otherwise; the engine runs each as an independent request."""
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a mapping of field names to values; unknown keys are an error."""
        return _from_mapping(cls, d, "sampling params must be a mapping", "sampling parameter(s)")


def default_of(name: str) -> Any:
    """``SamplingParams``' default for the field ``name``: vLLM's, and the OpenAI server's."""
    return next(f.default for f in dataclasses.fields(SamplingParams) if f.name == name)


# Where the command line differs from those defaults: ``tpspec generate`` and ``tpspec bench``
# decode greedily and longer, so that a demo or a benchmark gives the same text every run and
# enough tokens to read or to time. The server keeps the OpenAI API's (temperature 1, 16 tokens
# for completions), as vLLM's does.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 128}
