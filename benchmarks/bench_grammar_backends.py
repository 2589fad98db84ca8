"""Grammar engines on this CPU: llguidance and xgrammar, side by side (issue #40's choice).

For the default model's tokenizer (vocab 49,152) and Gemma 3's (262,144): the one-off tokenizer
set-up, then for each constraint of ``CASES`` (JSON schemas from flat to nested, arrays with
bounds, enums, patterns, nullable fields, number bounds; any JSON object (``json_object``); a regex; a choice list) the
compile time (schema to a matcher ready for its first mask, no cache) and the time of each
next-token mask along a valid output (the output's own tokens, consumed one by one), median and
95th percentile. One process, one thread per engine (xgrammar's compiler ``max_threads=1``).

xgrammar pulls torch, transformers and triton; it is not a tpspec dependency. Run where both are
installed, e.g. a scratch virtual environment:

  python3 -m venv /tmp/gv && /tmp/gv/bin/pip install torch==2.13.0 llguidance xgrammar
  PYTHONPATH=src /tmp/gv/bin/python benchmarks/bench_grammar_backends.py \
      --result-file benchmarks/results/grammar_backends.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpspec.bench.machine import machine_info
from tpspec.config import ModelArchConfig
from tpspec.models.loader.resolve import resolve_model
from tpspec.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": PERSON,
        "items": {
            "type": "array", "minItems": 1, "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "qty", "price"], "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "customer", "items", "note"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}

# (name, kind, constraint, a valid output)
CASES = [
    ("person", "json", PERSON, '{"name": "Ada Lovelace", "age": 36}'),
    ("tags", "json", TAGS, '["red", "green", "blue"]'),
    ("order", "json", ORDER,
     '{"id": "ABC-1234", "status": "shipped", "customer": {"name": "Bob", "age": 42}, '
     '"items": [{"sku": "x-1", "qty": 2, "price": 9.5}, {"sku": "y-2", "qty": 1, "price": 100}], "note": null}'),
    ("json-object", "json", {"type": "object"}, '{"answer": [1, 2, {"deep": true}], "text": "hello world"}'),
    ("regex", "regex", r"[0-9]{3}-[0-9]{3}-[0-9]{4}", "555-123-4567"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
]


def _time(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": round(statistics.median(us), 1), "p95_us": round(us[int(0.95 * (len(us) - 1))], 1),
            "max_us": round(us[-1], 1), "n": len(us)}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        import llguidance.numpy as llnp

        self.bitmask = llnp.allocate_token_bitmask(1, vocab)
        self.fill = llnp.fill_next_token_bitmask

    def compile(self, kind: str, constraint):
        m = self.llg.LLMatcher
        if kind == "json":
            grammar = m.grammar_from_json_schema(constraint)
        elif kind == "regex":
            grammar = m.grammar_from_regex(constraint)
        else:
            grammar = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint))
        matcher = m(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, matcher) -> None:
        self.fill(matcher, self.bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json_path: str, vocab: int, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_file=tokenizer_json_path), vocab_size=vocab, stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, constraint):
        c = self.compiler
        if kind == "json":
            compiled = c.compile_json_schema(json.dumps(constraint))
        elif kind == "regex":
            compiled = c.compile_regex(constraint)
        else:
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in constraint))
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def measure(backend_cls, model: str, repeats: int) -> dict:
    folder = resolve_model(model)
    arch = ModelArchConfig.from_folder(folder)
    tokenizer = Tokenizer.from_pretrained(folder)
    path = f"{folder}/tokenizer.json"
    arg = open(path).read() if backend_cls is Llguidance else path
    backend, setup_s = _time(lambda: backend_cls(arg, arch.vocab_size, tokenizer.eos_token_id))
    out = {"model": model or "default", "vocab": arch.vocab_size, "tokenizer_setup_s": round(setup_s, 3), "cases": {}}
    for name, kind, constraint, text in CASES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        compile_s, masks = [], []
        accepted = True
        for _ in range(repeats):
            matcher, s = _time(lambda: backend.compile(kind, constraint))
            compile_s.append(s)
            for t in ids:
                _, s = _time(lambda: backend.mask(matcher))
                masks.append(s)
                accepted = accepted and backend.accept(matcher, t)
        out["cases"][name] = {
            "tokens": len(ids), "output_accepted": accepted,
            "compile_ms": round(statistics.median(compile_s) * 1e3, 3), "mask": _summary(masks),
        }
        print(f"{backend.name:10s} {out['model']:14s} {name:9s} compile {out['cases'][name]['compile_ms']:8.3f} ms  "
              f"mask median {out['cases'][name]['mask']['median_us']:7.1f} us  p95 {out['cases'][name]['mask']['p95_us']:7.1f} us"
              f"  accepted {accepted}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default", "gemma-3-270m"])
    ap.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--result-file")
    args = ap.parse_args()
    classes = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    results = {"machine": machine_info(), "runs": []}
    for b in args.backends:
        for m in args.models:
            results["runs"].append({"backend": b, **measure(classes[b], None if m == "default" else m, args.repeats)})
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
