"""Resolve a speculative config's draft checkpoint and check it against the target, before any
worker starts (a bad drafter or flag fails fast, in the caller's process, with a ValueError)."""

from __future__ import annotations

import dataclasses
import json
import os

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.config.speculative_methods import SpeculativeMethod
from tpspec.models.loader.resolve import resolve_model

DRAFTERS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafters")


def _is_default_model(folder: str) -> bool:
    try:
        default = resolve_model(None)
    except FileNotFoundError:
        return False
    return os.path.realpath(default) == os.path.realpath(folder)


def shipped_drafter(method: SpeculativeMethod, target: str | None) -> str:
    """The folder of ``method``'s drafter shipped for ``target`` (a key of its ``shipped_drafters``)."""
    folder = os.path.join(DRAFTERS_DIR, method.shipped_drafters[target])
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise FileNotFoundError(f"the shipped {method.name} drafter is missing from {folder}")
    return folder


def is_shipped_drafter(folder: str | None) -> bool:
    """Whether ``folder`` is one of the drafters shipped in ``tpspec/drafters``."""
    return folder is not None and os.path.dirname(os.path.realpath(folder)) == os.path.realpath(DRAFTERS_DIR)


def _drafter_folder(spec: SpeculativeConfig, target_folder: str, target_name: str | None) -> str:
    """The draft checkpoint's folder: the config's, else the drafter shipped for the target, else
    (a method whose drafter the target's checkpoint holds) the target's own."""
    if spec.model is not None:
        return resolve_model(spec.model)
    method = spec.method_spec
    shipped = method.shipped_drafters
    if target_name not in shipped and _is_default_model(target_folder):
        target_name = None
    if target_name in shipped:
        return shipped_drafter(method, target_name)
    if method.model_from_target:
        return target_folder
    others = [f"--model {name}" for name in shipped if name is not None]
    raise ValueError(
        f"speculative_config.model is required for method {spec.method!r} unless the target is one that "
        f"tpspec ships a {method.name} drafter for: " + " or ".join(["the default model"] + others)
    )


def resolve_drafter(
    spec: SpeculativeConfig, target_folder: str, target: ModelArchConfig, target_name: str | None
) -> tuple[SpeculativeConfig, ModelArchConfig | None]:
    """Returns the config with ``model`` resolved to a folder and ``num_speculative_tokens`` to a
    number, and the draft's shape (None for a method with no model). ``target_name``: the target as
    the user named it (``--model``; None: the default model), which picks the shipped drafter; a
    path to the default model picks the default's. The drafter's checks (its checkpoint against
    the target, ``use_local_argmax_reduction`` against its draft model) are the speculator
    class's ``inspect_drafter``."""
    method = spec.method_spec
    if method.uses_model:
        spec = dataclasses.replace(spec, model=_drafter_folder(spec, target_folder, target_name))
    drafter = method.speculator_class().inspect_drafter(spec, target)
    if spec.num_speculative_tokens is None:
        if drafter.num_speculative_tokens is None:
            raise ValueError(
                f"speculative_config.num_speculative_tokens is required for method {spec.method!r}: "
                f"its drafter does not say how many drafts it was trained for"
            )
        spec = dataclasses.replace(spec, num_speculative_tokens=drafter.num_speculative_tokens)
    if spec.acceptance_prior is None and spec.model is not None:
        prior = measured_acceptance(spec.model)
        if prior is not None:
            spec = dataclasses.replace(spec, acceptance_prior=prior)
    return spec, drafter.arch


ACCEPTANCE_FILE = "acceptance.json"  # in a drafter's folder: what ``benchmarks/drafter_acceptance.py`` measured


def measured_acceptance(folder: str) -> tuple[float, ...] | None:
    """The greedy per-position acceptance rates a drafter's folder records (``ACCEPTANCE_FILE``:
    ``{"greedy_acceptance_rates": [α_1, α_2, …]}``, α_j given drafts 1 … j − 1 accepted), None
    where it records none."""
    path = os.path.join(folder, ACCEPTANCE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rates = json.load(f).get("greedy_acceptance_rates")
    return None if rates is None else tuple(rates)
