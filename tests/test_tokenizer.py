"""tpspec's Tokenizer (tokenizers + jinja2, no transformers) tokenizes and renders chat templates
exactly as transformers does, and fails clearly on bad folders and bad templates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpspec.default_model import default_model_path
from tpspec.models.loader.gguf import convert_gguf
from tpspec.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.  Twice\tspaced\n\nand new lines\r\n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * 31415926); }",
    "naïve café — Grüße, 東京タワー, Привет мир, مرحبا, 🤖🚀👍🏽 and ünïcödé",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|><repo_name>tpspec<file_sep>src/main.py\nprint('hi')",
    "   leading and trailing spaces   ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about tensors."},
        {"role": "assistant", "content": "Shards split the vocab\nranks reduce their local max\none id crosses wires"},
        {"role": "user", "content": "Now in 日本語, please 🙏"},
    ],
]


@pytest.fixture(scope="session")
def default_folder() -> str:
    return convert_gguf(default_model_path())


@pytest.fixture(scope="module")
def ours(default_folder) -> Tokenizer:
    return Tokenizer.from_pretrained(default_folder)


@pytest.fixture(scope="module")
def reference():
    """transformers' own tokenizer built from the GGUF file, parsed by gguf-py's own reader (the
    conversion under test parses it with ``GGUFFile``: this reference stays independent of that)."""
    from transformers import AutoTokenizer

    directory, filename = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=filename)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, reference, add_special_tokens):
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens).input_ids
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours, reference, skip_special_tokens):
    for text in TEXTS:
        ids = reference(text).input_ids
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text
    assert ours.decode(ours.encode(TEXTS[5])) == TEXTS[5]


def test_tokens_and_special_ids_match_transformers(ours, reference):
    ids = reference(TEXTS[7]).input_ids
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[0]) == reference.convert_ids_to_tokens(ids[0])
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(reference) == 49152
    # Every token the GGUF marks as control (ids 0-16) is special, transformers' named ones included.
    assert ours.all_special_ids == list(range(17))
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    with pytest.raises(ValueError, match="token id 49152 is out of range"):
        ours.convert_ids_to_tokens(49152)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, add_generation_prompt):
    assert ours.chat_template == reference.chat_template
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_does_not_import_transformers(default_folder):
    code = (
        "import sys; from tpspec.tokenizer import Tokenizer; "
        f"t = Tokenizer.from_pretrained({default_folder!r}); "
        "t.decode(t.encode(t.apply_chat_template([{'role': 'user', 'content': 'x'}]))); "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- a tiny hand-made folder: BOS/EOS flags, template edge cases, errors -----------------------


def _write_folder(folder, **config) -> str:
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world, hello tensors"] * 20, trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast", **config}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (False, True), (True, True), (False, False)])
def test_bos_eos_flags_match_transformers(tmp_path, add_bos, add_eos):
    from transformers import AutoTokenizer

    folder = _write_folder(tmp_path, add_bos_token=add_bos, add_eos_token=add_eos)
    ours = Tokenizer.from_pretrained(folder)
    # transformers 5 ignores these two keys of tokenizer_config.json when tokenizer.json exists
    # (its save_pretrained bakes them into tokenizer.json); passed explicitly, it honours them.
    reference = AutoTokenizer.from_pretrained(folder, add_bos_token=add_bos, add_eos_token=add_eos)
    ids = ours.encode("hello world")
    assert ids == reference("hello world").input_ids
    assert (ids[0] == ours.bos_token_id) is add_bos and (ids[-1] == ours.eos_token_id) is add_eos
    assert ours.encode("hello world", add_special_tokens=False) == ids[add_bos : len(ids) - add_eos]
    assert ours.decode(ids) == "hello world"


def test_template_variables_and_tojson(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{{ eos_token if add_generation_prompt else '' }}"
    )
    folder = _write_folder(tmp_path, chat_template=template)
    rendered = Tokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": "<b>&'é"}, {"role": "user", "content": "dropped"}]
    )
    assert rendered == '<s>{"role": "user", "content": "<b>&\'é"}</s>'


def test_template_from_chat_template_jinja(tmp_path):
    folder = _write_folder(tmp_path)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_no_chat_template(tmp_path):
    tokenizer = Tokenizer.from_pretrained(_write_folder(tmp_path))
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception(tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    tokenizer = Tokenizer.from_pretrained(_write_folder(tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_template_is_sandboxed(tmp_path):
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer.from_pretrained(_write_folder(tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="chat template failed to render.*unsafe"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    mutating = "{% set m = messages %}{{ m.append({'role': 'x'}) }}"
    tokenizer = Tokenizer.from_pretrained(_write_folder(tmp_path, chat_template=mutating))
    with pytest.raises(ValueError, match="chat template failed to render"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_syntax_error(tmp_path):
    tokenizer = Tokenizer.from_pretrained(_write_folder(tmp_path, chat_template="{% for m in messages %}"))
    with pytest.raises(ValueError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_folder_or_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="Tokenizer folder not found"):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
