"""Command line: ``tpspec generate``, ``tpspec serve`` (and, later, ``bench``)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tpspec.server.args import add_serve_args

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size in GiB (per engine, all layers)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides --kv-cache-memory-gb)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_kv_blocks=args.num_kv_blocks,
        seed=args.seed,
        speculative_config=args.speculative_config,
    )


def _generate(args: argparse.Namespace) -> int:
    from tpspec.llm import LLM
    from tpspec.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.request_seed, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or [DEFAULT_PROMPT]
    t0 = time.perf_counter()
    with LLM(**engine_kwargs(args)) as llm:
        logging.getLogger("tpspec").info("engine ready in %.1f s", time.perf_counter() - t0)
        t1 = time.perf_counter()
        if args.raw:
            outputs = llm.generate(prompts, params)
        else:
            outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
        dt = time.perf_counter() - t1
        n = sum(len(o.outputs[0].token_ids) for o in outputs)
        for p, o in zip(prompts, outputs):
            sys.stdout.write(f"\n### Prompt: {p}\n{o.outputs[0].text}\n[{len(o.outputs[0].token_ids)} tokens, finish_reason={o.outputs[0].finish_reason}]\n")
        sys.stdout.write(f"\n{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), TP {args.tensor_parallel_size}\n")
        stats = llm.get_stats()
        if "mean_acceptance_length" in stats:
            sys.stdout.write(f"mean acceptance length {stats['mean_acceptance_length']:.2f}\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tpspec.server.api import run_server

    return run_server(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpspec", description="Tensor-parallel LLM inference with speculative decoding")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline from one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable); default: a demo question")
    g.add_argument("--raw", action="store_true", help="feed prompts as raw text instead of through the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (vLLM's flag names)")
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        logging.getLogger("tpspec").error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
