"""Greedy draft sampling under TP: full-vocabulary all-gather vs local argmax (one run, same weights).

The LM head + greedy-sampling stage of a draft step, on ``--tp`` gloo ranks (spawned processes,
``--threads`` torch threads each), for each row count in ``--rows`` (480 = 32 requests × 15 drafts):
  LM head only   rank-local LM-head matmul (+ float32 cast), no communication: the floor
  off            ``compute_logits(h).argmax(-1)``: all-gather of every rank's shard logits
                 (4·padded_vocab bytes per row)
  on             ``get_top_tokens(h)`` (``use_local_argmax_reduction``): local argmax, then one
                 all-gather of packed (value, id) float32 pairs (8·tp bytes per row)
Time = median over ``--repeats`` repetitions (after ``--warmup``) of the slowest rank's time; the
ranks are lined up by a tiny all-reduce before each repetition. Gathered bytes are read from
``comm.get_comm_stats()`` (per call, per rank: the bytes of the gathered result). "on" and "off"
are checked to pick the same tokens. Weights: the default model's tied embedding (vocab 49152,
hidden 576) and hidden states drawn as N(0, 1) × its final-norm weight; ``--random-weights`` for a
synthetic head of ``--vocab`` × ``--hidden``.

  python3 benchmarks/bench_draft_sampling.py --result-file draft_sampling.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from tqdm import tqdm

from tpspec.bench.machine import machine_info

from lm_head_ranks import TORCH_DTYPES, add_head_args, load_head, model_folder, run_ranks, time_reps

logger = logging.getLogger("bench_draft_sampling")
SITE_OFF, SITE_ON, SITE_SYNC = "draft.sample.full", "draft.sample", "bench.sync"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_head_args(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 480], help="rows (draft tokens) per call")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tp < 1 or args.threads < 1 or args.warmup < 0 or args.repeats < 1 or min(args.rows) < 1:
        p.error("--tp, --threads, --repeats and --rows must be >= 1, --warmup >= 0")
    if args.random_weights and (args.vocab < 1 or args.hidden < 1):
        p.error("--vocab and --hidden must be >= 1")
    return args


# ---- one rank -------------------------------------------------------------------------------
def _rank_main(args, folder: str | None) -> dict:
    from tpspec.distributed import comm
    from tpspec.distributed.parallel_state import get_tp_rank
    from tpspec.layers.logits import LogitsProcessor

    dtype = TORCH_DTYPES[args.dtype]
    head, norm = load_head(args, folder, dtype)
    proc = LogitsProcessor(head.vocab_size)
    sync_buf = torch.zeros(1)

    def sync():
        comm.all_reduce(sync_buf, SITE_SYNC)

    results = []
    for rows in tqdm(args.rows, desc="row counts", unit="config", disable=get_tp_rank() != 0):
        g = torch.Generator().manual_seed(args.seed + rows)
        h = (torch.randn(rows, norm.numel(), generator=g) * norm).to(dtype)  # [rows, hidden_size]
        entry = dict(rows=rows)
        for flag, fn in (
            ("lm_head", lambda: proc.local_logits(head, h)),
            ("off", lambda: proc.compute_logits(head, h, SITE_OFF).argmax(-1)),
            ("on", lambda: proc.get_top_tokens(head, h, SITE_ON)),
        ):
            comm.reset_comm_stats()
            times, out = time_reps(fn, args.warmup, args.repeats, sync)
            stats = {k: v for k, v in comm.get_comm_stats().items() if k != SITE_SYNC}
            calls = sum(v["calls"] for v in stats.values())
            nbytes = sum(v["bytes"] for v in stats.values())
            entry[flag] = dict(times=times, bytes_per_call=nbytes // calls if calls else 0, sites=sorted(stats))
            if flag != "lm_head":
                entry[flag]["tokens"] = out.tolist()
        results.append(entry)
    return dict(vocab=head.vocab_size, padded_vocab=head.padded_vocab_size, hidden=norm.numel(), results=results)


# ---- report ---------------------------------------------------------------------------------
FLAG_LABEL = {"lm_head": "LM head only", "off": "off (full all-gather)", "on": "on (local argmax)"}


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for i, entry in enumerate(per_rank[0]["results"]):
        n = entry["rows"]
        med = {}
        for flag in ("lm_head", "off", "on"):
            # Per repetition, the slowest rank finishes the step.
            slowest = [max(r["results"][i][flag]["times"][k] for r in per_rank) for k in range(len(entry[flag]["times"]))]
            med[flag] = statistics.median(slowest) * 1e3
        same = entry["on"]["tokens"] == entry["off"]["tokens"] and all(
            r["results"][i]["on"]["tokens"] == entry["on"]["tokens"] for r in per_rank)
        for flag in ("lm_head", "off", "on"):
            nbytes = entry[flag]["bytes_per_call"]
            rows.append(dict(rows=n, flag=flag, time_ms=med[flag], gathered_bytes=nbytes, bytes_per_row=nbytes / n,
                             speedup=med["off"] / med[flag] if flag != "lm_head" else None,
                             off_outside_lm_head=(med["off"] - med["lm_head"]) / med["off"],
                             tokens_equal=same if flag == "on" else None))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| Rows | Flag | Time (ms) | Gathered bytes | Bytes/row | Speedup |", "|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"| {r['rows']} | {FLAG_LABEL[r['flag']]} | {r['time_ms']:.3f} | {r['gathered_bytes']:,} "
                     f"| {r['bytes_per_row']:,.0f} | {speed} |")
    notes = []
    for r in rows:
        if r["flag"] == "on":
            notes.append(f"- rows={r['rows']}: {100 * r['off_outside_lm_head']:.0f}% of the 'off' time is outside the "
                         f"LM head matmul (all-gather + full argmax); on/off tokens equal: {r['tokens_equal']}")
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    folder = model_folder(args)
    logger.info("TP %d over gloo, %d thread(s) per rank, %s, %s, rows %s, %d warm-up + %d repetitions",
                args.tp, args.threads, args.dtype, folder or f"random {args.vocab}x{args.hidden}", args.rows,
                args.warmup, args.repeats)
    start = time.perf_counter()
    per_rank = run_ranks(_rank_main, args, folder)
    info = {k: per_rank[0][k] for k in ("vocab", "padded_vocab", "hidden")}
    logger.info("done in %.1f s (vocab %d, padded %d, hidden %d)", time.perf_counter() - start,
                info["vocab"], info["padded_vocab"], info["hidden"])
    rows = summarize(per_rank)
    print(format_table(rows))
    if not all(r["tokens_equal"] for r in rows if r["flag"] == "on"):
        logger.error("get_top_tokens disagrees with compute_logits().argmax(-1)")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(dict(machine=machine_info(), args=vars(args), model=folder, **info, results=rows), f, indent=2)
        logger.info("wrote %s", args.result_file)
    return rows


if __name__ == "__main__":
    main()
