"""Sampling under TP: gathered logits vs vocab-parallel (one run, same weights, same noise).

The LM head + sampling stage on ``--tp`` gloo ranks (spawned processes, ``--threads`` torch
threads each), for each row count in ``--rows``, at ``--temperature`` (plus ``--top-k``,
``--top-p``, ``--min-p`` if given), for three stages:
  draft    probabilistic drafting: ``sample_draft_full(compute_logits(h))`` (gathered: all-gather
           of the full logits, full q) vs ``sample_draft_shard(compute_logits_shard(h))``
           (``use_local_argmax_reduction``: (value, id, local max) pairs and the exact mass Z;
           q stays sharded)
  verify   rejection sampling of ``--k`` probabilistic drafts per request (rows = requests ·
           (k + 1); a row count below k + 1 is one request with fewer drafts):
           ``RejectionSampler(compute_logits(h))`` with the full q vs
           ``VocabParallelRejectionSampler(compute_logits_shard(h))`` with q's local columns
  sample   plain sampling: ``Sampler(compute_logits(h))`` vs ``vocab_parallel.sample``
and the floor, ``lm head``: the rank-local LM-head matmul alone. Time = median over ``--repeats``
repetitions (after ``--warmup``) of the slowest rank's time; ranks are lined up by a tiny
all-reduce before each repetition. "Stage" time = total − LM head. Bytes per row are read from
``comm.get_comm_stats()`` (per rank, the collectives' result bytes). Gathered and vocab-parallel
are checked to pick the same tokens. Drafts and q for ``verify`` come from a perturbed copy of the
hidden states (so q != p and both acceptances and rejections occur), prepared outside the timing.
Weights: the default model's tied embedding (vocab 49152, hidden 576) and hidden states drawn as
N(0, 1) × its final-norm weight; ``--random-weights`` for a synthetic ``--vocab`` × ``--hidden``
head (e.g. to show bytes per row do not depend on the vocabulary).

  python3 benchmarks/bench_vocab_parallel_sampling.py --result-file vocab_parallel_sampling.json
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

logger = logging.getLogger("bench_vocab_parallel_sampling")
STAGES = ("draft", "verify", "sample")
MODES = ("gathered", "vocab-parallel")
SITE = {"draft": "draft.sample", "verify": "verify.sample", "sample": "sample"}
SITE_SYNC = "bench.sync"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_head_args(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512], help="sampled rows per call")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--k", type=int, default=3, help="draft tokens per request in the verify stage")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tp < 1 or args.threads < 1 or args.warmup < 0 or args.repeats < 1 or min(args.rows) < 1 or args.k < 0:
        p.error("--tp, --threads, --repeats and --rows must be >= 1, --warmup and --k >= 0")
    if not args.temperature > 0:
        p.error("--temperature must be > 0 (this benchmark measures random sampling)")
    if args.random_weights and (args.vocab < 1 or args.hidden < 1):
        p.error("--vocab and --hidden must be >= 1")
    return args


# ---- one rank -------------------------------------------------------------------------------
def _metadata(args, rows: int, first_position: int):
    from tpspec.sample.sampler import SamplingMetadata
    from tpspec.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    return SamplingMetadata.from_params([params] * rows, [args.seed + i for i in range(rows)],
                                        [first_position + i for i in range(rows)])


def _draft_counts(rows: int, k: int) -> list[int]:
    """k drafts per request (k + 1 rows each), the last request taking what is left."""
    full, rest = divmod(rows, k + 1)
    return [k] * full + ([rest - 1] if rest else [])


def _stage_fns(args, stage: str, rows: int, proc, head, h: torch.Tensor) -> dict:
    """{mode: fn} for one stage; each fn returns token ids (a list) on every rank."""
    from tpspec.sample import vocab_parallel
    from tpspec.sample.sampler import Sampler
    from tpspec.spec_decode.draft_sampling import sample_draft_full, sample_draft_shard
    from tpspec.spec_decode.rejection_sampler import RejectionSampler
    from tpspec.spec_decode.vocab_parallel_rejection import VocabParallelRejectionSampler

    site = SITE[stage]
    md = _metadata(args, rows, 100)
    if stage == "draft":
        return {
            "gathered": lambda: sample_draft_full(proc.compute_logits(head, h, site), md)[0].tolist(),
            "vocab-parallel": lambda: sample_draft_shard(proc.compute_logits_shard(head, h), md, site)[0].tolist(),
        }
    if stage == "sample":
        return {
            "gathered": lambda: Sampler()(proc.compute_logits(head, h, site), md).sampled_token_ids.tolist(),
            "vocab-parallel": lambda: vocab_parallel.sample(proc.compute_logits_shard(head, h), md, site).tolist(),
        }
    # verify: drafts and q from perturbed hidden states at the draft rows (untimed, uncounted).
    ks = _draft_counts(rows, args.k)
    draft_rows = [r for i, k in enumerate(ks) for r in range(i * (args.k + 1), i * (args.k + 1) + k)]
    drafts, q_full, q_local, q_d = torch.zeros(0, dtype=torch.int64), None, None, None
    if draft_rows:
        g = torch.Generator().manual_seed(args.seed + 1)
        h_draft = h[draft_rows] + 0.3 * h.float().std() * torch.randn(len(draft_rows), h.shape[1], generator=g).to(h.dtype)
        draft_md = _metadata(args, len(draft_rows), 100)
        drafts, q_full = sample_draft_full(proc.compute_logits(head, h_draft, "bench.setup"), draft_md)
        _, q_local = sample_draft_shard(proc.compute_logits_shard(head, h_draft), draft_md, "bench.setup")
        q_d = q_full.gather(1, drafts[:, None])[:, 0]

    def tokens(out) -> list[int]:
        return [t for ts in out.output_token_ids for t in ts]

    return {
        "gathered": lambda: tokens(RejectionSampler()(proc.compute_logits(head, h, site), drafts, ks, md, q_d, q_full)),
        "vocab-parallel": lambda: tokens(VocabParallelRejectionSampler()(
            proc.compute_logits_shard(head, h), drafts, ks, md, site, q_local)),
    }


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

    configs = [(stage, rows) for rows in args.rows for stage in args.stages]
    results = []
    for stage, rows in tqdm(configs, desc="configurations", unit="config", disable=get_tp_rank() != 0):
        g = torch.Generator().manual_seed(args.seed + rows)
        h = (torch.randn(rows, norm.numel(), generator=g) * norm).to(dtype)  # [rows, hidden_size]
        fns = {"lm head": lambda: proc.local_logits(head, h)}
        fns.update(_stage_fns(args, stage, rows, proc, head, h))
        entry = dict(stage=stage, rows=rows)
        for mode, fn in fns.items():
            comm.reset_comm_stats()
            times, out = time_reps(fn, args.warmup, args.repeats, sync)
            stats = {k: v for k, v in comm.get_comm_stats().items() if k not in (SITE_SYNC, "bench.setup")}
            nbytes = sum(v["bytes"] for v in stats.values())
            entry[mode] = dict(times=times, bytes_per_call=nbytes // (args.warmup + args.repeats),
                               calls_per_call=sum(v["calls"] for v in stats.values()) / (args.warmup + args.repeats),
                               tokens=out if mode != "lm head" else None)
        results.append(entry)
    return dict(vocab=head.vocab_size, padded_vocab=head.padded_vocab_size, hidden=norm.numel(), results=results)


# ---- report ---------------------------------------------------------------------------------
def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for i, entry in enumerate(per_rank[0]["results"]):
        med = {}
        for mode in ("lm head",) + MODES:
            # Per repetition, the slowest rank finishes the step.
            reps = range(len(entry[mode]["times"]))
            med[mode] = statistics.median(max(r["results"][i][mode]["times"][k] for r in per_rank) for k in reps) * 1e3
        same = entry["gathered"]["tokens"] == entry["vocab-parallel"]["tokens"] and all(
            r["results"][i][m]["tokens"] == entry[m]["tokens"] for r in per_rank for m in MODES)
        for mode in MODES:
            stage_ms = med[mode] - med["lm head"]
            nbytes = entry[mode]["bytes_per_call"]
            rows.append(dict(
                stage=entry["stage"], rows=entry["rows"], mode=mode, time_ms=med[mode], lm_head_ms=med["lm head"],
                stage_ms=stage_ms, bytes_per_call=nbytes, bytes_per_row=nbytes / entry["rows"],
                collectives_per_call=entry[mode]["calls_per_call"],
                stage_speedup=(med["gathered"] - med["lm head"]) / stage_ms if stage_ms > 0 else None,
                tokens_equal=same,
            ))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| Stage | Rows | Mode | Total (ms) | LM head (ms) | Stage (ms) | Stage speedup | Collectives | Bytes/row |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['stage_speedup']:.2f}x" if r["stage_speedup"] is not None else "-"
        lines.append(f"| {r['stage']} | {r['rows']} | {r['mode']} | {r['time_ms']:.2f} | {r['lm_head_ms']:.2f} "
                     f"| {r['stage_ms']:.2f} | {speed} | {r['collectives_per_call']:g} | {r['bytes_per_row']:,.0f} |")
    same = all(r["tokens_equal"] for r in rows)
    return "\n".join(lines + ["", f"gathered and vocab-parallel tokens equal everywhere: {same}"])


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    folder = model_folder(args)
    logger.info("TP %d over gloo, %d thread(s) per rank, %s, %s, rows %s, stages %s, temperature %g, "
                "%d warm-up + %d repetitions", args.tp, args.threads, args.dtype,
                folder or f"random {args.vocab}x{args.hidden}", args.rows, args.stages, args.temperature,
                args.warmup, args.repeats)
    start = time.perf_counter()
    per_rank = run_ranks(_rank_main, args, folder)
    info = {k: per_rank[0][k] for k in ("vocab", "padded_vocab", "hidden")}
    logger.info("done in %.1f s (vocab %d, padded %d, hidden %d)", time.perf_counter() - start,
                info["vocab"], info["padded_vocab"], info["hidden"])
    rows = summarize(per_rank)
    print(format_table(rows))
    if not all(r["tokens_equal"] for r in rows):
        logger.error("vocab-parallel sampling disagrees with the gathered path")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(dict(machine=machine_info(), args=vars(args), model=folder, **info, results=rows), f, indent=2)
        logger.info("wrote %s", args.result_file)
    return rows


if __name__ == "__main__":
    main()
