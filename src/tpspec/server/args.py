"""``tpspec serve`` flags (vLLM's names where vLLM has the flag). Kept free of heavy imports: the
CLI parses with it."""

from __future__ import annotations

import argparse

API_KEY_ENV = "TPSPEC_API_KEY"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags (vLLM's names); engine flags come from ``cli.add_engine_args``."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (the chosen one is logged)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: --model)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="turn CORS on for these origins ('*' = any); default: CORS off")
    p.add_argument("--headless", action="store_true",
                   help="run node --node-rank (>= 1) of a multi-node engine: its share of the TP ranks, no API server; "
                        "exits when the head does")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM compatibility; no effect")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="accepted for vLLM compatibility; size the KV cache with --kv-cache-memory-gb / --num-kv-blocks")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    g = p.add_argument_group("limits and shutdown")
    g.add_argument("--max-waiting-requests", type=int, default=128,
                   help="requests queued beyond the --max-num-seqs running ones; more get 429 with Retry-After")
    g.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="default: --max-model-len - 1")
    g.add_argument("--max-output-tokens", type=int, default=None,
                   help="most max_tokens a request may ask for (default: what the context leaves)")
    g.add_argument("--max-stop-strings", type=int, default=16)
    g.add_argument("--max-stop-string-length", type=int, default=256, help="characters")
    g.add_argument("--max-stop-token-ids", type=int, default=64)
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds from arrival to the last token; later requests end with 504 (default: none)")
    g.add_argument("--shutdown-grace-period", type=float, default=20.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")


def server_limits(args: argparse.Namespace):
    """The ``ServerLimits`` the flags describe (``ValueError`` for a bad value)."""
    from tpspec.server.limits import ServerLimits

    return ServerLimits(
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_stop_token_ids=args.max_stop_token_ids,
        request_timeout_s=args.request_timeout,
    )
