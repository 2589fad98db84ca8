"""The drafters trained with ``tpspec train-draft`` and shipped in ``tpspec/drafters``, used when a
speculative config names no ``model``: by method, then by the target as given to ``--model``
(None: the default model). No torch here: the config's checks read it."""

from __future__ import annotations

import os

SHIPPED_DRAFTERS = {
    "dflash": {None: "smollm2-135m-dflash", "gemma-3-270m": "gemma-3-270m-dflash"},
    "eagle3": {None: "smollm2-135m-eagle3"},
}
METHOD_ALIASES = {"eagle": "eagle3"}


def shipped_targets(method: str) -> dict[str | None, str]:
    """The targets tpspec ships a drafter of ``method`` (or its alias) for -> the drafter's folder name."""
    return SHIPPED_DRAFTERS.get(METHOD_ALIASES.get(method, method), {})


DRAFTERS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafters")


def rounds_drafter_to_q4_1(method: str, folder: str | None) -> bool:
    """Whether, under ``q4_1``, the drafter's own weights are rounded to Q4_1: the shipped EAGLE-3
    heads only. Measured (benchmarks/README.md): the default model's head keeps its acceptance
    (1.935 -> 1.929) and drafts a k 3 step in about 6 ms instead of 9; the shipped DFlash drafter
    loses some (1.266 -> 1.239 at k 15) and drafts no faster (17-19 against 18 ms), its 16-row
    products being no cheaper in Q4_1. Drafters a user supplies stay as loaded."""
    if METHOD_ALIASES.get(method, method) != "eagle3" or folder is None:
        return False
    return os.path.dirname(os.path.realpath(folder)) == os.path.realpath(DRAFTERS_DIR)


def shipped_drafter(method: str, target: str | None) -> str:
    """The folder of the ``method`` drafter shipped for ``target`` (a key of ``shipped_targets``)."""
    folder = os.path.join(DRAFTERS_DIR, shipped_targets(method)[target])
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise FileNotFoundError(f"the shipped {method} drafter is missing from {folder}")
    return folder
