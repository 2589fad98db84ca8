"""Command line: ``tpspec generate``, ``tpspec serve``, ``tpspec bench serve|compare``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from tpspec.bench.datasets import DATASETS
from tpspec.bench.server_options import ServerOptions
from tpspec.executor.node_link import NodeStartError
from tpspec.engine.engine_args import EngineArgs
from tpspec.sampling_params import CLI_SAMPLING_DEFAULTS, default_of
from tpspec.server.args import API_KEY_ENV, add_serve_args
from tpspec.train.recipe import AUTOCAST_OPTIONS, CODE_SOURCES, FEATURE_DTYPES, LOSS_VOCABS, TRAIN_DEVICES, TRAIN_METHODS, DraftRecipe, TrainConfig

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags (``EngineArgs.add_cli_args``) as ``LLM`` keywords."""
    return EngineArgs.from_cli(args).kwargs()


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
    from tpspec.server.lifecycle import run_server

    return run_server(args, engine_kwargs(args))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """What ``bench serve`` and ``bench compare`` send (vLLM's ``bench serve`` flag names)."""
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--dataset", default="humaneval", choices=DATASETS,
                   help="humaneval: the HumanEval prompts (text); shared-prefix: a ~1,500-token shared system prompt, then "
                   "a problem; multi-turn: chats resending their history, turn by turn; random: seeded random token "
                   "ids (completions only)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (seeded); inf = all at once")
    p.add_argument("--temperature", type=float, default=CLI_SAMPLING_DEFAULTS["temperature"])
    p.add_argument("--max-tokens", type=int, default=CLI_SAMPLING_DEFAULTS["max_tokens"], help="max output tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request generates --max-tokens")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt length of the random dataset")
    p.add_argument("--random-vocab-size", type=int, default=None,
                   help="the served tokenizer's vocabulary size (required by the random dataset)")
    p.add_argument("--disable-tqdm", action="store_true")


def workload_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dataset=args.dataset, num_prompts=args.num_prompts, endpoint=args.endpoint, request_rate=args.request_rate,
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
        num_warmups=args.num_warmups, random_input_len=args.random_input_len, random_vocab_size=args.random_vocab_size,
    )


def _bench_serve(args: argparse.Namespace) -> int:
    from tpspec.bench.report import format_serve_table, write_json
    from tpspec.bench.serve import Target, Workload, benchmark

    target = Target(args.base_url, model=args.model, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    workload = Workload(max_concurrency=args.max_concurrency, **workload_kwargs(args))
    try:
        result = benchmark(target, workload, show_progress=not args.disable_tqdm)
    except RuntimeError as e:
        logging.getLogger("tpspec").error("%s", e)
        return 1
    sys.stdout.write(format_serve_table(result) + "\n")
    if args.result_file:
        write_json(args.result_file, result)
        logging.getLogger("tpspec").info("wrote %s", args.result_file)
    return 0


def _bench_compare(args: argparse.Namespace) -> int:
    from tpspec.bench.compare import BASELINE, DEFAULT_SPECULATIVE_CONFIG, CompareConfig, run_compare
    from tpspec.bench.report import format_compare_table
    from tpspec.bench.serve import Workload

    try:
        spec = DEFAULT_SPECULATIVE_CONFIG if args.speculative_config is None else json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config must be JSON, got {args.speculative_config!r}: {e}") from None
    server = ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)})
    cfg = CompareConfig(
        server=server, workload=Workload(**workload_kwargs(args)), concurrencies=tuple(args.max_concurrency),
        speculative_config=spec, result_file=args.result_file, plot_file=args.plot_file,
        server_timeout_s=args.server_timeout, show_progress=not args.disable_tqdm, repeats=args.repeats,
    )
    try:
        out = run_compare(cfg)
    except RuntimeError as e:  # a server that died or never became healthy, a failed warm-up
        logging.getLogger("tpspec").error("%s", e)
        return 1
    sys.stdout.write(format_compare_table(out["summary"], BASELINE) + "\n")
    return 0


def add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="load-test an OpenAI-compatible server (tpspec, vLLM, llama.cpp)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL (without /v1)")
    s.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    s.add_argument("--api-key", default=None, help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    s.add_argument("--seed", type=int, default=0, help="arrivals, random prompts, per-request sampling seeds")
    s.add_argument("--num-warmups", type=int, default=0, help="requests sent before the measured run")
    s.add_argument("--result-file", default=None, help="write the result as JSON here")
    add_workload_args(s)
    s.set_defaults(func=_bench_serve)

    c = sub.add_parser("compare", help="use_local_argmax_reduction off vs on: start tpspec serve per config, load it, compare")
    EngineArgs.add_cli_args(  # passed to both servers (ServerOptions)
        c, only=tuple(f.name for f in dataclasses.fields(ServerOptions)),
        defaults={f.name: f.default for f in dataclasses.fields(ServerOptions)},
        help={"seed": "the servers' seed and the workload's",
              "sampling_mode": "the servers' verification/sampling mode (the same for both configs)"},
    )
    c.add_argument("--speculative-config", default=None,
                   help="the baseline's JSON (default: bench.compare.DEFAULT_SPECULATIVE_CONFIG, DFlash with 15 "
                        "tokens); the other config adds use_local_argmax_reduction=true")
    c.add_argument("--max-concurrency", type=int, nargs="+", default=[32], help="one or more concurrency levels")
    c.add_argument("--num-warmups", type=int, default=2, help="warm-up requests per server start")
    c.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for a server to be healthy")
    c.add_argument("--repeats", type=int, default=1,
                   help="rounds over both configs, alternating which goes first, with fresh servers; the table "
                        "gives each figure's mean and range, and says when a change is within the spread")
    c.add_argument("--result-file", default="bench_compare.json")
    c.add_argument("--plot-file", default=None, help="PNG chart (default: the result file with .png)")
    add_workload_args(c)
    c.set_defaults(func=_bench_compare)


def _train_draft(args: argparse.Namespace) -> int:
    from tpspec.train.train_draft import train_draft

    recipe = DraftRecipe(
        method=args.method, draft_vocab_size=args.draft_vocab_size, chain_depth=args.chain_depth,
        num_layers=args.num_layers, block_size=args.block_size, mask_token_id=args.mask_token_id,
        target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
        init_from_target=not args.random_init, code_sources=tuple(args.code_sources), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        text_tokens=args.text_tokens, feature_dtype=args.feature_dtype, max_num_seqs=args.max_num_seqs,
    )
    cfg = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                      lr=args.lr, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, seed=args.seed,
                      loss_vocab=args.loss_vocab, warmup_steps=args.warmup_steps, autocast=args.autocast,
                      device=args.device)
    last = train_draft(args.work_dir, args.output, args.model, recipe, cfg)
    sys.stdout.write(json.dumps(last, indent=2) + "\n")
    return 0


def add_train_draft_parser(sub) -> None:
    r, c = DraftRecipe, TrainConfig  # the defaults
    t = sub.add_parser("train-draft", help="train a drafter (DFlash, EAGLE-3 or MTP) for a target by self-distillation (resumable)")
    t.add_argument("--method", choices=TRAIN_METHODS, default=r.method)
    t.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--work-dir", required=True, help="data, checkpoints and the learning curve; rerun to resume")
    t.add_argument("--output", required=True, help="folder for the drafter in the method's public format")
    t.add_argument("--num-layers", type=int, default=r.num_layers, help="dflash: draft layers")
    t.add_argument("--block-size", type=int, default=r.block_size, help="dflash: draft block (k + 1)")
    t.add_argument("--draft-vocab-size", type=int, default=r.draft_vocab_size,
                   help="eagle3: the draft vocabulary (the tokens the target predicts most in the data)")
    t.add_argument("--chain-depth", type=int, default=r.chain_depth, help="eagle3, mtp: chain steps trained per position")
    t.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="target layers read (output of layer L); default: dflash 5 spread over the target, eagle3 EAGLE-3's three")
    t.add_argument("--mask-token-id", type=int, default=None, help="default: the last id of the target's vocabulary")
    t.add_argument("--random-init", action="store_true", help="dflash, mtp: do not start the draft layers from the target's last layers")
    t.add_argument("--code-sources", nargs="+", choices=CODE_SOURCES, default=list(r.code_sources),
                   help="where prompts and real text come from, in order: the standard library, the installed packages")
    t.add_argument("--num-prompts", type=int, default=r.num_prompts, help="prompts (documented functions) whose continuations are generated")
    t.add_argument("--max-tokens", type=int, default=r.max_tokens, help="continuation length per prompt")
    t.add_argument("--text-tokens", type=int, default=r.text_tokens, help="tokens of the code sources' files used as real text")
    t.add_argument("--feature-dtype", choices=FEATURE_DTYPES, default=r.feature_dtype,
                   help="dtype of the target forward that makes the features and labels")
    t.add_argument("--max-num-seqs", type=int, default=r.max_num_seqs, help="concurrent sequences while generating continuations")
    t.add_argument("--device", choices=TRAIN_DEVICES, default=c.device,
                   help="where generation, target features and training run (auto: CUDA when available)")
    t.add_argument("--steps", type=int, default=c.steps)
    t.add_argument("--seqs-per-step", type=int, default=c.seqs_per_step)
    t.add_argument("--anchors-per-seq", type=int, default=c.anchors_per_seq)
    t.add_argument("--lr", type=float, default=c.lr)
    t.add_argument("--warmup-steps", type=int, default=c.warmup_steps)
    t.add_argument("--autocast", choices=AUTOCAST_OPTIONS, default=c.autocast,
                   help="training matrix products in bfloat16 (auto: where the CPU has native bfloat16)")
    t.add_argument("--loss-vocab", choices=LOSS_VOCABS, default=c.loss_vocab,
                   help="the loss's softmax over the full vocabulary or over the tokens the target predicts in the data")
    t.add_argument("--checkpoint-every", type=int, default=c.checkpoint_every)
    t.add_argument("--eval-every", type=int, default=c.eval_every)
    t.add_argument("--seed", type=int, default=c.seed)
    t.set_defaults(func=_train_draft)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpspec", description="Tensor-parallel LLM inference with speculative decoding")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline from one or more prompts")
    EngineArgs.add_cli_args(g)
    g.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable); default: a demo question")
    g.add_argument("--raw", action="store_true", help="feed prompts as raw text instead of through the chat template")
    g.add_argument("--max-tokens", type=int, default=CLI_SAMPLING_DEFAULTS["max_tokens"])
    g.add_argument("--temperature", type=float, default=CLI_SAMPLING_DEFAULTS["temperature"])
    g.add_argument("--top-p", type=float, default=default_of("top_p"))
    g.add_argument("--top-k", type=int, default=default_of("top_k"))
    g.add_argument("--min-p", type=float, default=default_of("min_p"))
    g.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (vLLM's flag names)")
    EngineArgs.add_cli_args(s)
    add_serve_args(s)
    s.set_defaults(func=_serve)
    add_bench_parsers(sub.add_parser("bench", help="benchmark a server (serve) or the flag end to end (compare)"))
    add_train_draft_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the benchmark client's per-request lines
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        logging.getLogger("tpspec").error("%s", e)
        return 2
    except NodeStartError as e:  # a multi-node engine's node did not join, or left while starting
        logging.getLogger("tpspec").error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
