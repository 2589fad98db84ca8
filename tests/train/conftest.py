"""The training tests generate a few short sequences: their generation engines get a small KV
cache instead of the 2 GiB a real run's takes (zeroing it took about a second per engine)."""

from __future__ import annotations

import pytest

import tpspec.train.train_draft as train_draft


@pytest.fixture(autouse=True)
def small_generation_kv_cache(monkeypatch):
    monkeypatch.setitem(train_draft.GENERATION_KV_CACHE_GB, "cpu", 0.125)
