"""Text <-> token ids for a Hugging Face-format folder, on the `tokenizers` library alone.

transformers takes seconds to import, so the engine reads `tokenizer.json` and
`tokenizer_config.json` itself and renders chat templates with jinja2's sandbox, following
transformers' rules where they affect the result (BOS/EOS from add_bos_token/add_eos_token, the
template's variables and jinja settings).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A Hugging Face fast tokenizer plus its tokenizer_config.json: encode, decode, chat templates."""

    def __init__(self, backend: BackendTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._compiled_template: Template | None = None
        # bos_token etc. as strings; tokenizer_config.json may spell one as an AddedToken dict.
        self._special_tokens = {
            key: value["content"] if isinstance(value, dict) else value
            for key in _SPECIAL_TOKEN_KEYS
            if (value := config.get(key)) is not None
        }
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_post_processor(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))

    @classmethod
    def from_pretrained(cls, folder: str) -> Tokenizer:
        """Load from a folder holding tokenizer.json and, optionally, tokenizer_config.json.

        The chat template comes from tokenizer_config.json, else from chat_template.jinja.
        """
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"Tokenizer folder not found: {folder}")
        tokenizer_path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json; expected a Hugging Face model folder "
                "(convert a GGUF file with tpspec.models.loader.gguf.convert_gguf first)"
            )
        backend = BackendTokenizer.from_file(tokenizer_path)
        config_path = os.path.join(folder, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        chat_template = config.get("chat_template")
        template_path = os.path.join(folder, "chat_template.jinja")
        if chat_template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                chat_template = f.read()
        return cls(backend, config, chat_template)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """Put BOS/EOS around every encoded text as tokenizer_config.json says, replacing the
        post-processor of tokenizer.json (as transformers does when given the flags; transformers 5
        ignores the flags in the file and keeps tokenizer.json's, which its save_pretrained makes
        agree with them)."""
        ends: dict[str, str] = {}
        for key, wanted in (("bos_token", add_bos), ("eos_token", add_eos)):
            if wanted and key not in self._special_tokens:
                logger.warning("tokenizer_config.json sets add_%s but defines no %s; not adding it", key, key)
            elif wanted:
                ends[key] = self._special_tokens[key]

        def around(sequence: str, type_id: int) -> list[str]:
            pieces = [f"${sequence}:{type_id}"]
            if "bos_token" in ends:
                pieces.insert(0, f"{ends['bos_token']}:{type_id}")
            if "eos_token" in ends:
                pieces.append(f"{ends['eos_token']}:{type_id}")
            return pieces

        self._backend.post_processor = processors.TemplateProcessing(
            single=" ".join(around("A", 0)),
            pair=" ".join(around("A", 0) + around("B", 1)),
            special_tokens=[(token, self._backend.token_to_id(token)) for token in set(ends.values())],
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS as tokenizer_config.json asks."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; with skip_special_tokens, added tokens marked special (e.g. <|im_end|>)
        are dropped. No clean-up of spaces: transformers skips it for BPE tokenizers too."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        """Vocabulary entries (byte-level spelling, e.g. 'Ġhello') of one id or a list of ids."""
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(token_id) for token_id in ids]

    def _token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range; allowed: 0 to {self.vocab_size - 1}")
        return token

    def _special_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (a model's embedding may be padded beyond it)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of the special tokens: those `decode(..., skip_special_tokens=True)` drops,
        plus bos/eos/unk/pad."""
        ids = {token_id for token_id, token in self._backend.get_added_tokens_decoder().items() if token.special}
        ids.update(token_id for key in _SPECIAL_TOKEN_KEYS if (token_id := self._special_id(key)) is not None)
        return sorted(ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered with the model's chat template.

        `messages` are dicts like {"role": "user", "content": "Hi"}. The template is untrusted code
        and runs in jinja2's immutable sandbox; it sees `messages`, `add_generation_prompt`,
        `tools`/`documents` (None), the special tokens (`bos_token`, ...), `raise_exception` and
        `strftime_now`. Raises ValueError when there is no template or rendering fails.
        """
        if self._chat_template is None:
            raise ValueError(
                "This tokenizer has no chat template (no 'chat_template' in tokenizer_config.json and "
                "no chat_template.jinja); format the prompt yourself or use a chat model"
            )
        try:
            if self._compiled_template is None:
                self._compiled_template = _sandbox().from_string(self._chat_template)
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special_tokens,
            )
        except Exception as error:  # anything an untrusted template raises is a bad template or bad messages
            raise ValueError(f"The chat template failed to render: {error}") from error


class _TemplateError(Exception):
    """What a chat template's `raise_exception(message)` raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _sandbox() -> ImmutableSandboxedEnvironment:
    """The jinja environment chat templates are written for (the settings transformers uses)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
