"""Turn the user's ``model`` argument into a Hugging Face–format folder."""

from __future__ import annotations

import os

from tpspec.default_model import default_model_path
from tpspec.models.loader.gguf import convert_gguf
from tpspec.models.packaged import PACKAGED_MODELS, packaged_model_path


def resolve_model(model: str | None) -> str:
    """None → the embedded default model; a packaged model's short name (``PACKAGED_MODELS``) or
    a ``.gguf`` file → its cached conversion; a folder → itself."""
    if model is None:
        return convert_gguf(default_model_path())
    if model in PACKAGED_MODELS:
        return convert_gguf(packaged_model_path(model))
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return convert_gguf(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model folder {model!r} has no config.json")
        return path
    if os.path.exists(path):
        raise ValueError(f"model {model!r} is neither a .gguf file nor a Hugging Face model folder")
    raise FileNotFoundError(
        f"model {model!r} not found: pass a local .gguf file, a folder with config.json and "
        f"*.safetensors (models are never downloaded), one of {', '.join(PACKAGED_MODELS)}, "
        "or omit it to use the default model"
    )
