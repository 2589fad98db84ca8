"""What crossing a node boundary costs: TP 2 on one node (the ranks share memory) against the same
TP 2 as two "nodes" on this machine (``--nnodes 2``, the second a ``tpspec serve --headless``
process tree; every collective over gloo on loopback), end to end through ``tpspec serve``.

Each configuration runs in fresh processes, with ``OMP_NUM_THREADS=1`` (one thread per rank in
both, so the only difference is the transport), loaded by the same ``tpspec bench serve``
workload; ``--repeats`` rounds alternate which configuration goes first. Loopback gloo is a
lower bound on a real network's cost (no wire latency). The result file keeps each run's summary
figures, not its per-request records.

  python benchmarks/bench_multi_node.py --num-prompts 32 --max-concurrency 32 --max-tokens 64 --repeats 2 \\
      --result-file benchmarks/results/multi_node.json
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys

from tpspec.bench.compare import ServerProcess
from tpspec.bench.machine import machine_info
from tpspec.bench.report import write_json
from tpspec.bench.serve import Target, Workload, benchmark

logger = logging.getLogger("bench_multi_node")
CONFIGS = ("one node", "two nodes")


def _free_port_pair() -> int:
    """A port P with P + 1 also free (the head listens on P, the rendezvous takes P + 1)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def run_config(name: str, args: argparse.Namespace, log_dir: str, round_: int) -> dict:
    engine = ["--tensor-parallel-size", "2", *(["--model", args.model] if args.model else [])]
    node = None
    if name == "two nodes":
        port = _free_port_pair()
        engine += ["--nnodes", "2", "--master-port", str(port)]
        with open(os.path.join(log_dir, f"multi_node.r{round_}.node.log"), "w") as log:
            node = subprocess.Popen([sys.executable, "-m", "tpspec", "serve", "--headless", "--node-rank", "1", *engine],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    slug = name.replace(" ", "_")
    server = ServerProcess(engine, os.path.join(log_dir, f"multi_node.r{round_}.{slug}.server.log"))
    try:
        url = server.start(timeout_s=900)
        workload = Workload(num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                            max_tokens=args.max_tokens, ignore_eos=True, num_warmups=2)
        return benchmark(Target(url), workload, show_progress=False)
    finally:
        server.stop()
        if node is not None:
            node.wait(30)
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--result-file", default="multi_node.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the client's per-request lines
    os.environ["OMP_NUM_THREADS"] = "1"
    log_dir = os.path.dirname(os.path.abspath(args.result_file))
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.repeats):
        for name in CONFIGS if r % 2 == 0 else reversed(CONFIGS):
            result = run_config(name, args, log_dir, r)
            logger.info("%s, round %d: %.1f tok/s, mean TPOT %.1f ms", name, r, result["output_throughput"],
                        result["mean_tpot_ms"])
            runs[name].append({k: v for k, v in result.items() if not isinstance(v, (list, dict))})
    summary = {
        name: {
            "output_throughput": [x["output_throughput"] for x in rs],
            "mean_tpot_ms": [x["mean_tpot_ms"] for x in rs],
            "completed": [x["completed"] for x in rs],
        }
        for name, rs in runs.items()
    }
    write_json(args.result_file, {"machine": machine_info(), "args": vars(args), "summary": summary, "runs": runs})
    print("| Configuration | Throughput (tok/s), each round | Mean TPOT (ms), each round |")
    print("|---|---|---|")
    for name, s in summary.items():
        tput = ", ".join(f"{v:.1f}" for v in s["output_throughput"])
        tpot = ", ".join(f"{v:.0f}" for v in s["mean_tpot_ms"])
        print(f"| {name} | {tput} (mean {statistics.mean(s['output_throughput']):.1f}) | {tpot} |")


if __name__ == "__main__":
    main()
