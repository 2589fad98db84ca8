"""GGUF -> Hugging Face folder conversion: weights and config equal transformers' own GGUF loading,
the cache is keyed, atomic and fast, and bad input fails clearly."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from tokenizers.pre_tokenizers import ByteLevel

from tests.reference_models import transformers_gguf_model
import tpspec.models.loader.gguf as gguf_loader
from tpspec.default_model import default_model_path
from tpspec.models.loader.gguf import convert_gguf

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Shapes of the tiny models: hidden 64, 2 layers, FFN 96 (all multiples of Q8_0's 32-value blocks).
_TINY = {
    "llama": dict(num_heads=4, num_kv_heads=2, head_dim=16),
    # transformers' GGUF loader ignores qwen3's key_length and uses Qwen3Config's head_dim default, 128.
    "qwen3": dict(num_heads=2, num_kv_heads=1, head_dim=128),
}


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    *,
    tied: bool = True,
    metadata: dict | None = None,
    extra_tensors: tuple[str, ...] = (),
    skip_tensors: tuple[str, ...] = (),
    skip_keys: tuple[str, ...] = (),
) -> str:
    """A random-weight GGUF as llama.cpp writes one: Q8_0 matrices, F32 norms, a byte-level BPE
    tokenizer with a chat template. `metadata` adds "{arch}."-relative keys (float values);
    `skip_tensors` and `skip_keys` leave those tensors and metadata keys out."""
    shape = _TINY.get(arch, _TINY["llama"])
    hidden, ffn, layers = 64, 96, 2
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    tokens = _SPECIAL_TOKENS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "in", "Ġin"]
    rng = np.random.default_rng(0)

    writer = GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(_SPECIAL_TOKENS) + [1] * (len(tokens) - len(_SPECIAL_TOKENS)))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (len(tokens), hidden)
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
        if arch == "qwen3":
            shapes |= {f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)}
    shapes |= {name: (hidden,) for name in extra_tensors}
    for name, tensor_shape in shapes.items():
        if name in skip_tensors:
            continue
        if len(tensor_shape) == 1:  # norms: F32, around 1
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(tensor_shape)).astype(np.float32))
        else:
            values = (0.2 * rng.standard_normal(tensor_shape)).astype(np.float32)
            blocks = quantize(values, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    for key in skip_keys:
        del writer.kv_data[0][key]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _assert_same_weights(folder: str, reference_model) -> None:
    ours = load_file(os.path.join(folder, "model.safetensors"))
    reference = reference_model.state_dict()
    if reference_model.config.tie_word_embeddings:
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


# --- the default model (SmolLM2-135M-Instruct, Q4_1/Q8_0/F32) ---------------------------------


@pytest.fixture(scope="session")
def default_folder() -> str:
    # The default cache dir: converted once, then every test run reuses it.
    return convert_gguf(default_model_path())


@pytest.fixture(scope="module")
def transformers_default_model():
    return transformers_gguf_model(default_model_path())


def test_default_model_weights_equal_transformers(default_folder, transformers_default_model):
    _assert_same_weights(default_folder, transformers_default_model)


def test_default_model_config(default_folder, transformers_default_model):
    config = _read_config(default_folder)
    reference = transformers_default_model.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key, expected in dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, vocab_size=49152,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    ).items():
        assert config[key] == expected, key
        if key != "torch_dtype":
            assert getattr(reference, key) == expected, key
    # The GGUF stores float32 values; we write their shortest decimal form.
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert "rope_scaling" not in config
    with open(os.path.join(default_folder, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    with open(os.path.join(default_folder, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")
    assert tokenizer_config["add_bos_token"] is False
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_default_model_answers_sensibly(default_folder):
    """A wrong Q/K row order still loads but produces garbage; the right one knows Paris."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_folder)
    model = AutoModelForCausalLM.from_pretrained(default_folder, torch_dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def _refuse_to_convert(monkeypatch) -> None:
    """A cache hit reads nothing of the GGUF and writes nothing: any conversion fails the test."""

    def convert(*args):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(gguf_loader, "_write_folder", convert)


def test_default_model_second_call_is_cache_hit(default_folder, monkeypatch):
    _refuse_to_convert(monkeypatch)
    assert convert_gguf(default_model_path()) == default_folder


# --- tiny random GGUFs: llama and qwen3 against transformers ---------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen3", True)])
def test_tiny_model_matches_transformers(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(str(tmp_path / f"tiny-{arch}.gguf"), arch, tied=tied)
    folder = convert_gguf(path, cache_dir=str(tmp_path / "cache"))
    reference = transformers_gguf_model(path)
    _assert_same_weights(folder, reference)

    config = _read_config(folder)
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    assert config["head_dim"] == _TINY[arch]["head_dim"]
    # The folder loads into a model with the same logits: config and weights agree.
    ours = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 77, 200, 263, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_unpermute_restores_rotate_half_order():
    """llama.cpp moves Hugging Face row h*half + j of a head to row 2j + h; we move it back."""
    num_heads, head_dim = 2, 8
    hf_rows = np.arange(num_heads * head_dim, dtype=np.float32)[:, None].repeat(3, axis=1)  # [16, 3]
    half = head_dim // 2
    gguf_rows = hf_rows.reshape(num_heads, 2, half, 3).transpose(0, 2, 1, 3).reshape(-1, 3)
    assert gguf_rows[:4, 0].tolist() == [0, 4, 1, 5]
    np.testing.assert_array_equal(gguf_loader._unpermute_qk(gguf_rows, num_heads), hf_rows)


@pytest.mark.parametrize(
    "metadata,expected",
    [
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"rope.scaling.type": "none"}, None),
    ],
)
def test_rope_scaling(tmp_path, metadata, expected):
    path = write_tiny_gguf(str(tmp_path / "scaled.gguf"), metadata=metadata)
    config = _read_config(convert_gguf(path, cache_dir=str(tmp_path / "cache")))
    assert config.get("rope_scaling") == expected


# --- the cache -------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path) -> str:
    return write_tiny_gguf(str(tmp_path / "tiny.gguf"))


def _entries(cache: str) -> list[str]:
    return sorted(os.listdir(os.path.join(cache, "gguf")))


def test_cache_hit_and_key(tmp_path, tiny_gguf, caplog, monkeypatch):
    cache = str(tmp_path / "cache")
    with caplog.at_level("INFO", logger=gguf_loader.__name__):
        folder = convert_gguf(tiny_gguf, cache_dir=cache)
        assert "Converting" in caplog.text
        caplog.clear()
        with monkeypatch.context() as patched:
            _refuse_to_convert(patched)
            assert convert_gguf(tiny_gguf, cache_dir=cache) == folder
        assert "cached" in caplog.text
    assert os.path.dirname(folder) == os.path.join(cache, "gguf")
    assert sorted(os.listdir(folder)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    # A changed file (new mtime) is a new entry.
    stat = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert convert_gguf(tiny_gguf, cache_dir=cache) != folder
    assert len(_entries(cache)) == 2


def test_cache_dir_from_environment(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setenv("TPSPEC_CACHE_DIR", str(tmp_path / "env-cache"))
    folder = convert_gguf(tiny_gguf)
    assert folder.startswith(str(tmp_path / "env-cache" / "gguf") + os.sep)


def test_interrupted_conversion_leaves_no_entry(tmp_path, tiny_gguf, monkeypatch):
    cache = str(tmp_path / "cache")

    def fail(source: str, out_dir: str, reader) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, cache_dir=cache)
    assert _entries(cache) == []
    monkeypatch.undo()
    assert os.path.isfile(os.path.join(convert_gguf(tiny_gguf, cache_dir=cache), "tokenizer.json"))


def test_concurrent_conversions_share_one_entry(tmp_path, tiny_gguf, monkeypatch):
    """Both converters pass the cache check before either finishes; both end with one good folder."""
    cache = str(tmp_path / "cache")
    both_converting = threading.Barrier(2, timeout=60)
    save_tokenizer = gguf_loader._save_tokenizer

    def save_after_both_started(source: str, out_dir: str, reader) -> None:
        both_converting.wait()
        save_tokenizer(source, out_dir, reader)

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", save_after_both_started)
    results: list[str] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(convert_gguf(tiny_gguf, cache_dir=cache))
        except BaseException as error:  # surfaced by the assert below
            errors.append(error)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert _entries(cache) == [os.path.basename(results[0])]
    assert len(load_file(os.path.join(results[0], "model.safetensors"))) == 2 + 2 * 9


# --- bad input -------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf(str(tmp_path / "nope.gguf"), cache_dir=str(tmp_path / "cache"))


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "falcon.gguf"), "falcon")
    with pytest.raises(ValueError, match=r"architecture 'falcon'.*supported architectures: llama, qwen3"):
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))
    assert _entries(str(tmp_path / "cache")) == []


def test_unknown_tensor(tmp_path):
    # Llama 3.1-style per-dimension rope factors have no place in a Hugging Face llama folder.
    path = write_tiny_gguf(str(tmp_path / "freqs.gguf"), extra_tensors=("rope_freqs.weight",))
    with pytest.raises(ValueError, match="'rope_freqs.weight' has no Hugging Face counterpart"):
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))


def test_missing_tensor(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "partial.gguf"), skip_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))


def test_unsupported_rope_scaling(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "longrope.gguf"), metadata={"rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="rope scaling type 'longrope'"):
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))


def test_the_plain_array_reader_parses_as_gguf_py_and_stands_in_for_it_once(tmp_path):
    """``GGUFFile`` (gguf-py's reader over a plain array view of the memory map) gives gguf-py's
    fields and tensors; inside ``parsed_once`` transformers' ``gguf.GGUFReader`` of that file is the
    parse, of another file a new reader of it, and after it gguf-py's own again."""
    import gguf

    path, other = write_tiny_gguf(str(tmp_path / "a.gguf")), write_tiny_gguf(str(tmp_path / "b.gguf"), "qwen3")
    ours, theirs = gguf_loader.GGUFFile(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert [part.tobytes() for part in ours.fields[name].parts] == [part.tobytes() for part in field.parts], name
        assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]
    original = gguf.GGUFReader
    with gguf_loader.parsed_once(ours):
        assert gguf.GGUFReader(path) is ours
        assert gguf.GGUFReader(other).fields["general.architecture"].contents() == "qwen3"
        assert issubclass(gguf.GGUFReader, original)  # a class: isinstance checks against it still work
    assert gguf.GGUFReader is original


@pytest.mark.parametrize("missing", ["key", "embedding"])
def test_a_gguf_without_what_the_config_needs_is_a_clear_error(tmp_path, missing):
    path = str(tmp_path / "bad.gguf")
    if missing == "embedding":
        write_tiny_gguf(path, skip_tensors=("token_embd.weight",))
        message = "has no token embedding tensor 'token_embd.weight'"
    else:
        write_tiny_gguf(path, skip_keys=("llama.embedding_length",))
        message = "has no metadata key 'llama.embedding_length'"
    with pytest.raises(ValueError, match=re.escape(f"GGUF file {path} {message}")):
        convert_gguf(path, cache_dir=str(tmp_path / "cache"))
