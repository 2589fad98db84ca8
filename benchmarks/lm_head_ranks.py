"""What the LM-head sampling benchmarks (``bench_draft_sampling.py``,
``bench_vocab_parallel_sampling.py``) share: the head's command-line options, this rank's shard of
the default model's (or a random) LM head, repetition timing, and running a function on ``--tp``
spawned gloo ranks."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import traceback

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model folder, .gguf or gemma-3-270m (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--random-weights", action="store_true", help="random head of --vocab x --hidden, no model needed")
    p.add_argument("--vocab", type=int, default=49152, help="vocab size with --random-weights")
    p.add_argument("--hidden", type=int, default=576, help="hidden size with --random-weights")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (gloo ranks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")


def model_folder(args) -> str | None:
    """The converted model folder, or None with ``--random-weights``."""
    if args.random_weights:
        return None
    from tpspec.models.loader.resolve import resolve_model

    return resolve_model(args.model)


def load_head(args, folder: str | None, dtype: torch.dtype):
    """The LM head (this rank's shard) and the per-channel scale of the hidden states [hidden]."""
    from tpspec.layers.vocab_parallel import ParallelLMHead

    if folder is None:
        g = torch.Generator().manual_seed(args.seed)
        weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
        head = ParallelLMHead(args.vocab, args.hidden, dtype)
        head.weight_loader(head.weight, weight.to(dtype))
        return head, torch.ones(args.hidden)
    from safetensors import safe_open

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in keys
        sl = f.get_slice("model.embed_tokens.weight" if tied else "lm_head.weight")
        _, hidden = sl.get_shape()
        head = ParallelLMHead(cfg["vocab_size"], hidden, dtype)
        if head.num_real:  # only this rank's rows
            rows = sl[head.vocab_start : head.vocab_start + head.num_real]
            head.weight.data[: head.num_real].copy_(rows.to(dtype))
        norm = f.get_tensor("model.norm.weight").float() if "model.norm.weight" in keys else torch.ones(hidden)
    from tpspec.config import ModelArchConfig
    from tpspec.models.registry import get_model_class

    norm = norm + get_model_class(ModelArchConfig.from_hf_config(cfg).architecture).norm_weight_offset  # Gemma: 1 + w
    return head, norm


def time_reps(fn, warmup: int, repeats: int, sync) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls of ``fn`` (after ``warmup`` calls; ``sync`` lines the
    ranks up before each), and the last call's result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def _entry(rank: int, rank_main, args, folder: str | None, init_method: str, queue) -> None:
    from tpspec.distributed.parallel_state import destroy_distributed, init_distributed

    try:
        torch.set_num_threads(args.threads)
        init_distributed(rank, args.tp, init_method, "gloo", torch.device("cpu"), 600)
        queue.put((rank, "ok", rank_main(args, folder)))
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed()


def run_ranks(rank_main, args, folder: str | None) -> list[dict]:
    """``rank_main(args, folder)`` (a module-level function) on ``args.tp`` spawned gloo ranks;
    each rank's result, in rank order."""
    from tpspec.distributed.parallel_state import get_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{get_free_port()}"
    procs = [ctx.Process(target=_entry, args=(r, rank_main, args, folder, init_method, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(args.tp):
            rank, status, value = queue.get(timeout=3600)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(args.tp)]
