"""Resolve a speculative config's draft checkpoint and check it against the target, before any
worker starts (a bad drafter fails fast, in the caller's process, with a ValueError)."""

from __future__ import annotations

import dataclasses
import os

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.models.dflash import DFlashConfig
from tpspec.models.eagle3 import Eagle3Config
from tpspec.models.loader.resolve import resolve_model
from tpspec.models.mtp import MTPConfig
from tpspec.models.registry import get_model_class


def _is_default_model(folder: str) -> bool:
    try:
        default = resolve_model(None)
    except FileNotFoundError:
        return False
    return os.path.realpath(default) == os.path.realpath(folder)


def resolve_drafter(
    spec: SpeculativeConfig, target_folder: str, target: ModelArchConfig, target_name: str | None
) -> tuple[SpeculativeConfig, ModelArchConfig | None]:
    """Returns the config with ``model`` resolved to a folder, and the draft's shape (None for ngram).
    ``target_name``: the target as the user named it (``--model``; None: the default model), which
    picks the shipped drafter; a path to the default model picks the default's."""
    if spec.method == "ngram":
        return spec, None
    if spec.model is None:  # only a method with shipped drafters, or mtp, may omit it (SpeculativeConfig checks)
        from tpspec.spec_decode.shipped import shipped_drafter, shipped_targets

        shipped = shipped_targets(spec.method)
        if target_name not in shipped and _is_default_model(target_folder):
            target_name = None
        if target_name in shipped:
            model = shipped_drafter(spec.method, target_name)
        elif spec.method == "mtp":
            model = target_folder  # the target's own MTP layers, as vLLM reads them
        else:
            others = [f"--model {name}" for name in shipped if name is not None]
            raise ValueError(
                f"speculative_config.model is required for method {spec.method!r} unless the target is one that "
                f"tpspec ships a {spec.method} drafter for: " + " or ".join(["the default model"] + others)
            )
        spec = dataclasses.replace(spec, model=model)
    else:
        spec = dataclasses.replace(spec, model=resolve_model(spec.model))
    if spec.method == "dflash":
        dflash = DFlashConfig.from_folder(spec.model)
        dflash.validate(target, spec.num_speculative_tokens)
        return spec, dflash.arch
    if spec.method == "mtp":
        mtp = MTPConfig.from_folder(spec.model)
        mtp.validate(target)
        return spec, mtp.arch
    if spec.method in ("eagle3", "eagle"):
        from tpspec.spec_decode.eagle import ships_embedding

        eagle = Eagle3Config.from_folder(spec.model)
        eagle.validate(target, ships_embedding(spec.model))
        return spec, eagle.arch
    draft_arch = ModelArchConfig.from_folder(spec.model)
    if spec.method == "draft_model":
        get_model_class(draft_arch.architecture)
    return spec, draft_arch
