"""``tpspec serve``'s process: the objects built before it serves (the model, the app) are frozen
out of the garbage collector's full collections before the first request, and uvicorn runs on
uvloop and httptools."""

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


def test_the_server_runs_on_uvloop_and_httptools():
    """uvicorn's pure-Python event loop and HTTP parser made one served stream pay 1.23-1.37x
    offline decoding's TPOT on 2 cores, uvloop and httptools 1.11x: ``tpspec serve``'s
    configuration must resolve to them (both are tpspec's dependencies)."""
    from tpspec.cli import build_parser

    args = build_parser().parse_args(["serve"])
    config = lifecycle.uvicorn_config(lambda scope, receive, send: None, args)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory().__module__.startswith("uvloop")
