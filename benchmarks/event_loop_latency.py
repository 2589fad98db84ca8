"""How long the server's HTTP event loop takes to answer while the engine works: ``GET /health``
polled (one request at a time, 3 ms apart) during one request's long prompt (its prefill: ~2,500
tokens in chunks) and during one stream's decoding, against a fresh ``tpspec serve`` each time.
The engine thread runs the CPU kernels; whatever holds the GIL through a kernel call keeps the
loop from answering until the call returns.

With ``--baseline-commit C`` the same rounds run against a server of commit C too (a temporary git
worktree, its CPU kernels built in a directory of their own), the two taking turns, the order
reversed every other round.

  python3 benchmarks/event_loop_latency.py --baseline-commit HEAD~1 --rounds 3 --result-file benchmarks/results/event_loop_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from tpspec.bench.compare import ServerProcess
from tpspec.bench.machine import machine_info
from tpspec.bench.report import write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def long_prompt(lines: int) -> str:
    return "def fib(n):\n" + " ".join(f"x{i} = {i} * fib({i})" for i in range(lines))


def post(url: str, body: dict) -> float:
    """Send a completion request and wait for its whole answer; its latency in seconds."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()
    return time.perf_counter() - t0


def health_latencies(url: str, body: dict, max_polls: int) -> tuple[list[float], float]:
    """/health latencies (ms) while ``body`` is served, and that request's latency (s)."""
    latency, errors = [], []

    def send() -> None:
        try:
            latency.append(post(url, body))
        except Exception as e:  # noqa: BLE001 - reported below, in this thread
            errors.append(e)

    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.05)
    polls = []
    while worker.is_alive() and len(polls) < max_polls:
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=60) as resp:
            resp.read()
        polls.append(1000 * (time.perf_counter() - t0))
        time.sleep(0.003)
    worker.join()
    if errors:
        raise SystemExit(f"the request failed: {errors[0]!r}")
    if not polls:
        raise SystemExit("the request ended before the first poll: make it longer (--prompt-lines, --decode-tokens)")
    return polls, latency[0]


def summary(polls: list[float]) -> dict:
    s = sorted(polls)
    return {"polls": len(s), "median_ms": statistics.median(s), "p90_ms": s[int(0.9 * len(s))],
            "p99_ms": s[int(0.99 * len(s))], "max_ms": s[-1]}


def run_server(name: str, env: dict | None, args, log_dir: str) -> dict:
    server = ServerProcess([], os.path.join(log_dir, f"{name}.server.log"), env=env)
    try:
        url = server.start(timeout_s=900)
        with urllib.request.urlopen(url + "/v1/models") as resp:
            model = json.load(resp)["data"][0]["id"]
        post(url, {"model": model, "prompt": "def add(a, b):", "max_tokens": 8})  # warm-up
        out = {}
        polls, latency = health_latencies(url, {"model": model, "prompt": long_prompt(args.prompt_lines), "max_tokens": 8,
                                                "temperature": 0}, args.max_polls)
        out["prefill"] = {**summary(polls), "request_s": latency}
        polls, latency = health_latencies(url, {"model": model, "prompt": "def fib(n):", "max_tokens": args.decode_tokens,
                                                "ignore_eos": True, "temperature": 0}, args.max_polls)
        out["decode"] = {**summary(polls), "request_s": latency}
        return out
    finally:
        server.stop()


def baseline_worktree(commit: str, root: str) -> dict:
    """A worktree of ``commit`` under ``root``; the environment that runs its server."""
    tree = os.path.join(root, "tree")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, commit], check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": os.path.join(tree, "src"), "TORCH_EXTENSIONS_DIR": os.path.join(root, "kernels")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-commit", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-lines", type=int, default=250, help="the long prompt's lines (250: ~2,500 tokens)")
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--max-polls", type=int, default=300)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="event_loop_latency.")
    variants = [("current", None)]
    if args.baseline_commit:
        variants.insert(0, (args.baseline_commit, baseline_worktree(args.baseline_commit, root)))
    runs = []
    try:
        for i in range(args.rounds):
            for name, env in variants if i % 2 == 0 else variants[::-1]:
                result = run_server(name, env, args, root)
                runs.append({"server": name, "round": i, **result})
                for phase in ("prefill", "decode"):
                    r = result[phase]
                    print(f"round {i} {name:>10} {phase:>7}: /health median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f}, "
                          f"p99 {r['p99_ms']:.2f}, max {r['max_ms']:.2f} ({r['polls']} polls); request {r['request_s']:.2f} s",
                          flush=True)
    finally:
        if args.baseline_commit:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", os.path.join(root, "tree")], check=False)
    if args.result_file:
        write_json(args.result_file, {"machine": machine_info(), "args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
