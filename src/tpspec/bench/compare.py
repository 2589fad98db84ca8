"""``tpspec bench compare``: ``use_local_argmax_reduction`` off vs on, end to end on one machine.

For each configuration in turn (baseline = the speculative config as given; local_argmax = the
same plus ``"use_local_argmax_reduction": true``) a ``tpspec serve`` subprocess is started on a free
loopback port, warmed up, loaded with the same workload at each concurrency level (``bench.serve``),
and stopped (SIGTERM, then SIGKILL to its whole process group after a grace period: no orphaned
TP workers). With ``repeats`` > 1 the configurations alternate over that many rounds (baseline
first, then flagged first, ...), each with fresh servers, so that both meet the machine's slow
changes of speed alike; the summary gives each figure's mean and range over the rounds. The runs
go to a JSON file and a PNG chart; the CLI prints the comparison table. The speculation length
is pinned (``"adaptive": false``) unless the config sets ``adaptive``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tpspec.bench.machine import machine_info
from tpspec.bench.report import plot_comparison, summarize, write_json
from tpspec.bench.serve import Target, Workload, benchmark
from tpspec.bench.server_options import ServerOptions

logger = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_CONFIG = {"method": "dflash", "num_speculative_tokens": 15}
FLAG = "use_local_argmax_reduction"
BASELINE = "baseline"
FLAGGED = "local_argmax"
LOG_TAIL_LINES = 40
_READY = re.compile(r"server ready: (http://[0-9.]+:\d+)")


class ServerStartError(RuntimeError):
    """A server died or did not become healthy in time (the message has its log tail)."""


def _log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """``python -m tpspec serve`` in its own session (process group), listening on a free loopback
    port (``--port 0``; the port is read from its 'server ready' log line), logging to ``log_path``.
    With ``command`` and ``url`` instead: any OpenAI-compatible server (vLLM, transformers,
    llama.cpp) started by that command line, listening where the caller told it to, ready when
    ``ready_path`` answers 200."""

    def __init__(self, serve_argv: list[str], log_path: str, *, command: list[str] | None = None,
                 url: str | None = None, env: dict[str, str] | None = None, ready_path: str = "/health",
                 name: str = "tpspec serve") -> None:
        if (command is None) != (url is None):
            raise ValueError("ServerProcess: give both command and url (another server), or neither (tpspec serve)")
        self.serve_argv = serve_argv
        self.log_path = log_path
        self.command = command
        self.env = env
        self.ready_path = ready_path
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.url: str | None = url
        self._log = None

    def _exited(self) -> bool:
        """Whether the server exited, without reaping it: while it is an unreaped zombie its process
        group id cannot be reused, so killing the group can only hit what it left behind."""
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self, timeout_s: float) -> str:
        """Start the server and wait until ``ready_path`` answers 200; its base URL."""
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")
        cmd = self.command or [
            sys.executable, "-m", "tpspec", "--log-level", "INFO", "serve", *self.serve_argv, "--host", "127.0.0.1",
            "--port", "0", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        logger.info("starting %s (log: %s)", " ".join(cmd[1:]), self.log_path)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._exited():
                self.stop()
                raise ServerStartError(f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                                       f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            if self.url is None:
                with open(self.log_path, encoding="utf-8", errors="replace") as f:
                    m = _READY.search(f.read())
                self.url = m.group(1) if m else None
            if self.url is not None and self._healthy():
                return self.url
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} was not healthy after {timeout_s:g} s (raise --server-timeout "
                                       f"if it is just slow); last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, up to ``grace_s`` for a clean exit, then SIGKILL to whatever is left of the
        server's process group; reaps the server. Its exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            if not self._exited():
                os.kill(self.proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while not self._exited() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self._exited():
                    logger.warning("%s did not stop within %g s of SIGTERM; killing it", self.name, grace_s)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _default_spec() -> dict[str, Any]:
    return dict(DEFAULT_SPECULATIVE_CONFIG)


@dataclass(frozen=True)
class CompareConfig:
    server: ServerOptions = ServerOptions()
    workload: Workload = Workload(num_prompts=64, num_warmups=2)  # max_concurrency is set per level
    concurrencies: tuple[int, ...] = (32,)
    speculative_config: dict[str, Any] = field(default_factory=_default_spec)
    result_file: str = "bench_compare.json"
    plot_file: str | None = None  # None: result_file with a .png suffix
    server_timeout_s: float = 900.0
    show_progress: bool = True
    repeats: int = 1  # rounds over both configurations, in alternating order

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if not isinstance(spec, dict) or "method" not in spec:
            raise ValueError(f"speculative_config must be a JSON object with a 'method', got {spec!r}")
        if spec.get(FLAG):
            raise ValueError(f"speculative_config.{FLAG} must be false or absent in the baseline (the comparison "
                             f"turns it on itself), got {spec[FLAG]!r}")
        # k pinned unless asked otherwise (the seed experiment's fixed k = 15; an adaptive k would
        # follow each server's own timings, and the two runs would not verify the same drafts).
        object.__setattr__(self, "speculative_config", {"adaptive": False, **spec})
        if not self.concurrencies or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be one or more integers >= 1, got {self.concurrencies!r}")
        if len(set(self.concurrencies)) != len(self.concurrencies):
            raise ValueError(f"concurrencies must not repeat, got {self.concurrencies!r}")
        object.__setattr__(self, "concurrencies", tuple(self.concurrencies))
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")
        if not self.server_timeout_s > 0:
            raise ValueError(f"server_timeout_s must be > 0, got {self.server_timeout_s!r}")
        if self.plot_file is None:
            object.__setattr__(self, "plot_file", os.path.splitext(self.result_file)[0] + ".png")

    def configs(self) -> list[tuple[str, dict[str, Any]]]:
        return [(BASELINE, dict(self.speculative_config)), (FLAGGED, {**self.speculative_config, FLAG: True})]


def run_compare(cfg: CompareConfig) -> dict[str, Any]:
    """Run every configuration at every concurrency level, ``repeats`` rounds; write the JSON and
    the PNG; return the JSON's content (``runs``: one ``bench serve`` result per (round, config,
    concurrency), with ``config`` and ``round``; ``summary``: ``report.summarize`` of them)."""
    runs: list[dict[str, Any]] = []
    stem = os.path.splitext(cfg.result_file)[0]
    for round_ in range(cfg.repeats):
        configs = cfg.configs() if round_ % 2 == 0 else cfg.configs()[::-1]
        for name, spec in configs:
            log = f"{stem}.{name}.server.log" if cfg.repeats == 1 else f"{stem}.{name}.round{round_}.server.log"
            with ServerProcess(cfg.server.argv(spec), log) as server:
                url = server.start(cfg.server_timeout_s)
                for i, concurrency in enumerate(cfg.concurrencies):
                    w = dataclasses.replace(cfg.workload, max_concurrency=concurrency,
                                            num_warmups=cfg.workload.num_warmups if i == 0 else 0)
                    logger.info("round %d/%d, config %s, max concurrency %d", round_ + 1, cfg.repeats, name, concurrency)
                    result = benchmark(Target(url), w, cfg.show_progress)
                    runs.append({"config": name, "round": round_, "speculative_config": spec, **result})
    summary = summarize(runs)
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "machine": machine_info(),  # the servers', as they ran beside the client
        "server": dataclasses.asdict(cfg.server),
        "speculative_config": cfg.speculative_config,
        "concurrencies": list(cfg.concurrencies),
        "baseline": BASELINE,
        "repeats": cfg.repeats,
        "summary": summary,
        "runs": runs,
    }
    write_json(cfg.result_file, out)
    plot_comparison(summary, cfg.plot_file, title=f"{FLAG}: off ({BASELINE}) vs on ({FLAGGED}), "
                                                f"TP {cfg.server.tensor_parallel_size}")
    logger.info("wrote %s and %s", cfg.result_file, cfg.plot_file)
    return out
