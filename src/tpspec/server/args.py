"""``tpspec serve`` flags (vLLM's names). Kept free of heavy imports: the CLI parses with it."""

from __future__ import annotations

import argparse

API_KEY_ENV = "TPSPEC_API_KEY"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags (vLLM's names); engine flags come from ``cli.add_engine_args``."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (the chosen one is logged)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: --model)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM compatibility; no effect")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="accepted for vLLM compatibility; size the KV cache with --kv-cache-memory-gb / --num-kv-blocks")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
