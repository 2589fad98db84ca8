"""From ``StructuredOutputsParams`` to xgrammar matchers, each grammar compiled once per process.

xgrammar (vLLM's and SGLang's default grammar engine) was chosen over llguidance on this CPU
(benchmarks/bench_grammar_backends.py; docs/structured-outputs.md): its next-token masks cost
1-60 µs at vocab 49,152 and 262,144 where llguidance's cost 8-540 µs (a bounded string: 0.15-0.54
ms median), and a step under speculation computes one per verified and drafted position; its
slower compilation (5-40 ms per JSON schema) happens once per schema and off the engine loop.

One ``GrammarCompiler`` per (tokenizer file, vocabulary, stop tokens) and process: xgrammar's
view of the tokenizer is built in a background thread from the first use; compiled grammars are
kept by xgrammar's own cache (keyed by the grammar text), and each request gets its own matcher.
"""

from __future__ import annotations

import json
import re
import threading

from tpspec.sampling_params import StructuredOutputsParams

# JSON schemas compile with at most this many whitespace characters in a row where JSON allows
# any: a small model in a greedy whitespace loop would otherwise run to max_tokens.
MAX_JSON_WHITESPACE = 4


class GrammarError(ValueError):
    """A constraint the grammar engine rejects: the message is xgrammar's, ``field`` the
    ``StructuredOutputsParams`` field it came from."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# xgrammar 0.2.9 writes a string with minLength / maxLength as characters of [^"\\\r\n], which
# lets raw control characters (U+0000-U+001F) into a JSON string (its unbounded strings exclude
# them, as JSON requires). Such a string's characters are rewritten to exclude them too.
_LAX_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str, disable_any_whitespace: bool) -> str:
    """The EBNF grammar (xgrammar's) of a JSON schema: free whitespace (at most
    ``MAX_JSON_WHITESPACE`` in a row) unless ``disable_any_whitespace``."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(
        schema, any_whitespace=not disable_any_whitespace,
        max_whitespace_cnt=None if disable_any_whitespace else MAX_JSON_WHITESPACE,
    )
    return str(grammar).replace(_LAX_STRING_CHARS, _JSON_STRING_CHARS)


class GrammarCompiler:
    """Compiles constraints against one tokenizer; hands out matchers."""

    def __init__(self, tokenizer_json_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._build, args=(tokenizer_json_path,), name="tpspec-grammar-tokenizer",
                         daemon=True).start()

    def _build(self, path: str) -> None:
        try:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            info = xgrammar.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_file=path), vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        except BaseException as e:  # reported to whoever compiles first
            self._error = e
        finally:
            self._ready.set()

    @property
    def compiler(self):
        """xgrammar's compiler (waits for the background set-up)."""
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"the grammar engine could not read the tokenizer: {self._error}")
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The constraint's ``xgrammar.CompiledGrammar`` (a cache hit after the first time).
        Raises ``GrammarError`` with xgrammar's message for a malformed schema, regex or grammar,
        or a feature it does not support."""
        c = self.compiler
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_grammar(json_schema_grammar(params.json if kind == "json" else '{"type": "object"}',
                                                             params.disable_any_whitespace))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in params.choice))
            return c.compile_grammar(params.grammar)  # EBNF (GBNF, llama.cpp's syntax), root rule "root"
        except (RuntimeError, ValueError, TypeError) as e:
            message = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e)).strip()  # xgrammar's "[time] file.cc:line: "
            raise GrammarError(f"structured_outputs.{kind}: {message}", kind) from None

    def matcher(self, params: StructuredOutputsParams):
        """A fresh ``xgrammar.GrammarMatcher`` at the start of the constraint."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(params))


_COMPILERS: dict[tuple[str, int, tuple[int, ...]], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def grammar_compiler(tokenizer_json_path: str, vocab_size: int, stop_token_ids) -> GrammarCompiler:
    """This process's compiler for the tokenizer (the driver and a rank in the same process share
    one, so a grammar the driver checked is a cache hit for the rank)."""
    key = (tokenizer_json_path, vocab_size, tuple(sorted(stop_token_ids)))
    with _COMPILERS_LOCK:
        if key not in _COMPILERS:
            _COMPILERS[key] = GrammarCompiler(tokenizer_json_path, vocab_size, list(key[2]))
        return _COMPILERS[key]
