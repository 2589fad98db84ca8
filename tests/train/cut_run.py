"""A training run cut between checkpoints and rerun, beside the same run uncut: what the resume
tests of every method compare."""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file

from tpspec.train.train_draft import train_draft
from tpspec.train.trainer import DraftTrainer

DATA_FOLDERS = ("generated", "features", "held_out_generated", "held_out_features")


def uncut_and_resumed(tmp_path, monkeypatch, target: str, recipe, cfg, prompts, held_out, cut_at: int = 13):
    """Train in ``a`` uncut; then in ``b`` over a copy of a's data, killed at step ``cut_at`` and
    rerun. Returns both runs' last curve points and exported tensors (uncut, resumed, a, b)."""
    uncut = train_draft(str(tmp_path / "a"), str(tmp_path / "a-out"), target, recipe, cfg, prompts, held_out)
    os.makedirs(tmp_path / "b")
    for name in DATA_FOLDERS:
        shutil.copytree(tmp_path / "a" / name, tmp_path / "b" / name)
    step = DraftTrainer.train_step

    def dying(self):
        if self.step == cut_at:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(DraftTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train_draft(str(tmp_path / "b"), str(tmp_path / "b-out"), target, recipe, cfg, prompts, held_out)
    monkeypatch.setattr(DraftTrainer, "train_step", step)
    resumed = train_draft(str(tmp_path / "b"), str(tmp_path / "b-out"), target, recipe, cfg, prompts, held_out)
    a, b = load_file(str(tmp_path / "a-out" / "model.safetensors")), load_file(str(tmp_path / "b-out" / "model.safetensors"))
    return uncut, resumed, a, b
