"""``tpspec bench compare`` end to end on the tiny model at TP 1: two real ``tpspec serve``
processes (baseline, then with ``use_local_argmax_reduction``), two concurrency levels, the JSON,
the PNG and the table; no server process left behind; a server that dies at start is a clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("matplotlib")

from tpspec.bench.compare import (  # noqa: E402
    BASELINE,
    DEFAULT_SPECULATIVE_CONFIG,
    FLAG,
    FLAGGED,
    CompareConfig,
    ServerOptions,
    ServerProcess,
    ServerStartError,
)
from tpspec.cli import main  # noqa: E402

K = 3


def _processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``text``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/status") as f:
                zombie = "\nState:\tZ" in f.read()
        except OSError:
            continue
        if text in cmdline and not zombie:
            pids.append(int(pid))
    return pids


@pytest.fixture
def model(tiny_llama, tmp_path) -> str:
    """A private copy of the tiny model: its path identifies this test's servers in /proc."""
    return shutil.copytree(tiny_llama, str(tmp_path / "model-under-compare"))


def test_compare_end_to_end(model, tmp_path, capsys):
    from tpspec.tokenizer import Tokenizer

    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": K}
    result_file = tmp_path / "out" / "compare.json"
    rc = main(["bench", "compare", "--model", model, "--tensor-parallel-size", "1", "--speculative-config", json.dumps(spec),
               "--dataset", "random", "--random-input-len", "12",
               "--random-vocab-size", str(Tokenizer.from_pretrained(model).vocab_size),
               "--num-prompts", "4", "--max-concurrency", "1", "4", "--max-tokens", "8", "--num-warmups", "1",
               "--max-model-len", "128", "--num-kv-blocks", "64", "--result-file", str(result_file), "--disable-tqdm"])
    assert rc == 0
    assert _processes_mentioning(model) == []  # both servers (and anything they started) are gone

    out = json.loads(result_file.read_text())
    runs = out["runs"]
    assert [(r["config"], r["max_concurrency"]) for r in runs] == [(BASELINE, 1), (BASELINE, 4), (FLAGGED, 1), (FLAGGED, 4)]
    assert [r["speculative_config"].get(FLAG) for r in runs] == [None, None, True, True]
    assert all(r["speculative_config"]["adaptive"] is False for r in runs)  # k pinned by default
    assert out["server"]["tensor_parallel_size"] == 1 and out["concurrencies"] == [1, 4]
    for r in runs:
        assert (r["completed"], r["failed"]) == (4, 0)
        assert r["spec_decode_acceptance_rate"] == 1.0  # self-draft, greedy: every draft accepted
        assert r["output_throughput"] > 0 and r["mean_tpot_ms"] > 0
    # Greedy speculation is lossless with the flag on or off: the same tokens in every run.
    assert len({tuple(r["output_lens"]) for r in runs}) == 1

    png = result_file.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    for name in (BASELINE, FLAGGED):
        assert "server ready" in (tmp_path / "out" / f"compare.{name}.server.log").read_text()

    table = capsys.readouterr().out
    assert "| Config | Concurrency | Output throughput (tok/s) | Mean TPOT (ms) | Acceptance length | Draft bytes/token |" in table
    rows = [line for line in table.splitlines() if line.startswith(f"| {FLAGGED} |")]
    assert len(rows) == 2 and all("%)" in row for row in rows)  # changes against the baseline


def test_a_server_that_dies_at_start_is_a_clear_error(model, tmp_path):
    bad = {"method": "draft_model", "model": str(tmp_path / "no-such-draft"), "num_speculative_tokens": K}
    server = ServerProcess(ServerOptions(model=model, tensor_parallel_size=1).argv(bad), str(tmp_path / "s.log"))
    with pytest.raises(ServerStartError, match=r"exited with status \d+ before it was ready") as e:
        server.start(timeout_s=120)
    assert "no-such-draft" in str(e.value)  # the server's own error, from its log tail
    assert server.proc.returncode not in (None, 0) and _processes_mentioning(model) == []


def test_stop_kills_a_server_that_ignores_sigterm_and_what_it_started(tmp_path):
    """A stand-in server that ignores SIGTERM and has a child of its own (as a TP worker): after the
    grace period both are killed (the whole process group), and the server is reaped."""
    marker = f"stand-in-server-{uuid.uuid4().hex}"
    code = (f"import signal, subprocess, sys, time  # {marker}\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # {marker}'])\n"
            "time.sleep(120)\n")
    server = ServerProcess([], str(tmp_path / "s.log"))
    server.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(_processes_mentioning(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_mentioning(marker)) == 2
    assert server.stop(grace_s=0.5) == -signal.SIGKILL
    deadline = time.monotonic() + 10  # the orphaned child is reaped by init, not by us
    while _processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(marker) == []
    assert server.stop() == -signal.SIGKILL  # idempotent


def test_compare_config_validation():
    pinned = {**DEFAULT_SPECULATIVE_CONFIG, "adaptive": False}  # k pinned unless the config says otherwise
    assert CompareConfig().speculative_config == pinned
    assert CompareConfig(speculative_config={**DEFAULT_SPECULATIVE_CONFIG, "adaptive": True}).speculative_config["adaptive"]
    assert CompareConfig(result_file="x/r.json").plot_file == "x/r.png"
    with pytest.raises(ValueError, match=FLAG):
        CompareConfig(speculative_config={**DEFAULT_SPECULATIVE_CONFIG, FLAG: True})
    with pytest.raises(ValueError, match="method"):
        CompareConfig(speculative_config={"num_speculative_tokens": 3})
    for bad in ((), (0,), (4, 4)):
        with pytest.raises(ValueError, match="concurrencies"):
            CompareConfig(concurrencies=bad)
    configs = dict(CompareConfig().configs())
    assert FLAG not in configs[BASELINE] and configs[FLAGGED] == {**pinned, FLAG: True}
