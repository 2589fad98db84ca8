"""``tpspec serve``'s process: the objects built before it serves (the model, the app) are frozen
out of the garbage collector's full collections before the first request."""

from __future__ import annotations

import gc
import types

import pytest

uvicorn = pytest.importorskip("uvicorn")

from tpspec.server import lifecycle  # noqa: E402


def test_startup_objects_are_frozen_before_serving(monkeypatch):
    """Unfrozen, a full collection walked the model's objects mid-stream (128 ms at one stream of the
    default model with EAGLE-3), and the engine's step waited for it."""
    frozen_when_run = []
    monkeypatch.setattr(lifecycle.GracefulServer, "run", lambda self, sockets=None: frozen_when_run.append(gc.get_freeze_count()))
    config = uvicorn.Config(lambda *a: None, host="127.0.0.1", port=0)
    engine = types.SimpleNamespace(dead_error=None)
    gc.unfreeze()
    try:
        assert lifecycle.serve(engine, config, 1.0, "test") == 0
    finally:
        gc.unfreeze()
    assert len(frozen_when_run) == 1 and frozen_when_run[0] > 10_000  # this process's objects, all of them
