"""Grammar masks under TP 2: every rank computing its own, or rank 0 computing and sending them.

A step of c constrained sequences needs c·(k + 1) mask rows (verification; drafting as many
again, pass by pass). Every rank running its own matcher costs each rank the masks' computation
(xgrammar's ``fill_next_token_bitmask``, measured here along a valid JSON output) and no bytes;
one rank computing them costs the others a transfer of vocab/8 bytes per row (6 KB at vocab
49,152, 32 KB at 262,144) per pass: timed here as the engine's shared-memory all-gather (what a
one-to-all copy would cost at best on one host) and as a gloo broadcast (what crosses nodes),
median of ``--repeats``, for 1 to 224 rows.

  python3 benchmarks/bench_mask_exchange.py --result-file benchmarks/results/mask_exchange.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

from tpspec.bench.machine import machine_info

ROWS = (1, 8, 32, 224)
VOCABS = {"default": 49152, "gemma-3-270m": 262144}


def _rank(rank: int, port: int, repeats: int, queue) -> None:
    import torch.distributed as dist

    from tpspec.distributed import comm
    from tpspec.distributed.parallel_state import destroy_distributed, get_state, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo", torch.device("cpu"), 120)
    out = {}
    for name, vocab in VOCABS.items():
        words = -(-vocab // 32)
        for rows in ROWS:
            x = torch.full((rows, words), -1, dtype=torch.int32)
            for how in ("shm_all_gather", "gloo_broadcast"):
                times = []
                for _ in range(repeats):
                    comm.barrier() if hasattr(comm, "barrier") else dist.barrier(group=get_state().cpu_group)
                    t0 = time.perf_counter()
                    if how == "shm_all_gather":
                        comm.all_gather(x, "bench", dim=0)
                    else:
                        dist.broadcast(x, src=0, group=get_state().cpu_group)
                    times.append(time.perf_counter() - t0)
                out[f"{name}/{rows}/{how}"] = statistics.median(times) * 1e3
    destroy_distributed()
    if rank == 0:
        queue.put(out)


def compute_ms(model: str | None, rows: int) -> float:
    """Milliseconds to compute ``rows`` masks along a valid output (xgrammar), median per mask × rows."""
    from tpspec.config import ModelArchConfig
    from tpspec.models.loader.resolve import resolve_model
    from tpspec.sample.token_bitmask import words_for
    from tpspec.sampling_params import StructuredOutputsParams
    from tpspec.structured.grammar import grammar_compiler
    from tpspec.tokenizer import Tokenizer

    folder = resolve_model(model)
    arch = ModelArchConfig.from_folder(folder)
    tok = Tokenizer.from_pretrained(folder)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["name", "year"]}
    matcher = grammar_compiler(os.path.join(folder, "tokenizer.json"), arch.vocab_size,
                               list(arch.eos_token_ids)).matcher(StructuredOutputsParams(json=schema))
    row = torch.empty(1, words_for(arch.vocab_size), dtype=torch.int32)
    times = []
    for t in tok.encode('{"name": "Ada Lovelace", "year": 1815}', add_special_tokens=False):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(row, 0)
        times.append(time.perf_counter() - t0)
        matcher.accept_token(t)
    return statistics.median(times) * 1e3 * rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--result-file")
    args = ap.parse_args()
    from tpspec.distributed.parallel_state import get_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    sent = queue.get(timeout=600)
    for p in procs:
        p.join()
    result = {"machine": machine_info(), "rows": {}}
    for name in VOCABS:
        for rows in ROWS:
            own = compute_ms(None if name == "default" else name, rows)
            shm, gloo = sent[f"{name}/{rows}/shm_all_gather"], sent[f"{name}/{rows}/gloo_broadcast"]
            result["rows"][f"{name}/{rows}"] = {"compute_ms": own, "shm_all_gather_ms": shm, "gloo_broadcast_ms": gloo}
            print(f"{name:13s} rows {rows:4d}: compute on every rank {own:7.3f} ms | send from rank 0: "
                  f"shm all-gather {shm:7.3f} ms, gloo broadcast {gloo:7.3f} ms", flush=True)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
