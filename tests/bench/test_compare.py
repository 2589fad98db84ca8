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
    # Greedy speculation is lossless with the flag on or off: the same text for every prompt in every run.
    assert all(t for r in runs for t in r["generated_texts"])
    assert len({tuple(r["generated_texts"]) for r in runs}) == 1, [r["generated_texts"] for r in runs]

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
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="repeats"):
            CompareConfig(repeats=bad)


def test_repeats_alternate_the_configs_with_fresh_servers_and_summarize(tmp_path, monkeypatch):
    """Rounds alternate which config goes first, each server starts afresh, and the table gives
    means with ranges, saying when a change is inside the spread."""
    import tpspec.bench.compare as compare

    started, served = [], []

    class FakeServer:
        def __init__(self, argv, log_path):
            self.log_path = log_path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self, timeout_s):
            started.append(os.path.basename(self.log_path))
            return "http://127.0.0.1:1"

    # Throughput by (config, round): the flag's gain is clear at concurrency 4 (ranges apart) and
    # inside the spread at concurrency 1.
    figures = {(BASELINE, 1): (10.0, 14.0), (FLAGGED, 1): (11.0, 13.0), (BASELINE, 4): (20.0, 22.0), (FLAGGED, 4): (30.0, 32.0)}

    def fake_benchmark(target, w, show_progress):
        name = started[-1].split(".")[1]
        round_ = int(started[-1].split(".round")[1][0])
        served.append((name, round_, w.max_concurrency))
        tok_s = figures[(name, w.max_concurrency)][round_]
        return {"max_concurrency": w.max_concurrency, "output_throughput": tok_s, "mean_tpot_ms": 1000 / tok_s,
                "spec_decode_acceptance_length": 2.0, "draft_bytes_per_draft_token": None}

    monkeypatch.setattr(compare, "ServerProcess", FakeServer)
    monkeypatch.setattr(compare, "benchmark", fake_benchmark)
    monkeypatch.setattr(compare, "plot_comparison", lambda *a, **k: None)
    cfg = CompareConfig(concurrencies=(1, 4), repeats=2, result_file=str(tmp_path / "c.json"), show_progress=False)
    out = compare.run_compare(cfg)
    assert started == [f"c.{BASELINE}.round0.server.log", f"c.{FLAGGED}.round0.server.log",
                       f"c.{FLAGGED}.round1.server.log", f"c.{BASELINE}.round1.server.log"]
    assert [r["round"] for r in out["runs"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert out["machine"]["cpu"] and out["machine"]["isa"] is not None and out["repeats"] == 2
    rows = {(r["config"], r["max_concurrency"]): r for r in out["summary"]}
    assert rows[(FLAGGED, 4)]["output_throughput"] == 31.0 and rows[(FLAGGED, 4)]["rounds"] == 2
    assert (rows[(BASELINE, 1)]["output_throughput_min"], rows[(BASELINE, 1)]["output_throughput_max"]) == (10.0, 14.0)
    assert rows[(BASELINE, 1)]["draft_bytes_per_draft_token"] is None

    from tpspec.bench.report import format_compare_table

    table = format_compare_table(out["summary"], BASELINE).splitlines()
    flagged = {int(line.split("|")[2]): line.split("|")[3].strip() for line in table if line.startswith(f"| {FLAGGED} |")}
    assert flagged[1] == "12.0 (11.0–13.0) (+0.0%, within the spread)"
    assert flagged[4] == "31.0 (30.0–32.0) (+47.6%)"
