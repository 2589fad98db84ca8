"""What the structured-outputs tests check an ended output against: its own constraint."""

from __future__ import annotations

import json
import re

import jsonschema

from tpspec.sampling_params import StructuredOutputsParams


def assert_satisfies(so: StructuredOutputsParams, text: str) -> None:
    """``text`` validates against ``so.json`` (``jsonschema``), matches ``so.regex`` whole, or is one
    of ``so.choice``."""
    if so.json is not None:
        jsonschema.validate(json.loads(text), json.loads(so.json))
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), (so.regex, text)
    elif so.choice is not None:
        assert text in so.choice, (so.choice, text)
    else:
        raise AssertionError(f"no check for {so}")
