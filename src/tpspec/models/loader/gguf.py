"""GGUF checkpoint -> cached Hugging Face-format folder.

A GGUF file holds a model under llama.cpp's tensor names, mostly quantized, with the Q/K rows of
llama models reordered for llama.cpp's rotary kernel, and its tokenizer as metadata.
`convert_gguf` undoes all of that once (config.json, float32 model.safetensors, tokenizer files,
generation_config.json) and caches the folder, so every later load reads an ordinary Hugging Face
folder and a repeated call costs a `stat`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from tpspec.config import GEMMA3_LOCAL_ROPE_THETA, GEMMA3_SLIDING_WINDOW_PATTERN

logger = logging.getLogger(__name__)

# Part of the cache key: bump it whenever the folder this module writes changes.
CONVERTER_VERSION = 1
CACHE_DIR_ENV = "TPSPEC_CACHE_DIR"
SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "gemma3")

_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_HF_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.{i}.<gguf leaf> -> model.layers.{i}.<hf leaf>
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Qwen3 normalizes every head's q and k (one weight of head_dim, shared by all heads).
_QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3 norms four times per layer: before and after attention, before and after the MLP.
_GEMMA3_NORM_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_BLOCK_NAMES_BY_ARCH = {
    "llama": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "gemma3": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_GEMMA3_NORM_NAMES},
}
# llama.cpp's converter reorders Q/K rows for its llama models only; its Qwen3 converter does not.
_PERMUTED_QK_ARCHS = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its kernel scales by the weight alone);
# Hugging Face checkpoints hold w.
_NORM_PLUS_ONE_ARCHS = ("gemma3",)
# What a Gemma 3 GGUF does not say is set as llama.cpp sets it (GEMMA3_SLIDING_WINDOW_PATTERN,
# GEMMA3_LOCAL_ROPE_THETA), and the score scale by the 27B model's layer count.
_GEMMA3_27B_LAYERS = 62
_ROPE_SCALING_TYPES = ("none", "linear", "yarn")
_REQUIRED = object()


def convert_gguf(path: str, cache_dir: str | None = None) -> str:
    """Path of a Hugging Face-format folder converted from the GGUF at `path`, cached.

    The cache lives in `cache_dir`, else `$TPSPEC_CACHE_DIR`, else `~/.cache/tpspec`, under
    `gguf/<name>-<hash of (absolute path, size, mtime, CONVERTER_VERSION)>`. A conversion is written
    to a temporary folder and renamed into place, so an interrupted conversion leaves no entry and
    two processes converting the same file at once both end up with one complete folder.
    """
    source = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(source):
        raise FileNotFoundError(f"GGUF file not found: {source}")
    root = os.path.join(cache_root(cache_dir), "gguf")
    target = os.path.join(root, _cache_key(source))
    if os.path.isdir(target):
        logger.info("Using cached conversion of %s at %s", source, target)
        return target

    logger.info("Converting %s to a Hugging Face folder at %s (once; later loads use the cache)", source, target)
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=root)
    try:
        _write_folder(source, staging)
        os.rename(staging, target)
    except OSError:
        # Renaming onto a folder that exists fails: another process converted the file first.
        if not os.path.isdir(target):
            raise
        logger.info("Another process converted %s first; using its folder %s", source, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_root(cache_dir: str | None = None) -> str:
    """tpspec's cache folder: ``cache_dir``, else ``$TPSPEC_CACHE_DIR``, else ``~/.cache/tpspec``."""
    root = cache_dir or os.environ.get(CACHE_DIR_ENV) or os.path.join("~", ".cache", "tpspec")
    return os.path.abspath(os.path.expanduser(root))


def _cache_key(source: str) -> str:
    stat = os.stat(source)
    identity = json.dumps([source, stat.st_size, stat.st_mtime_ns, CONVERTER_VERSION])
    digest = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    return f"{stem}-{digest}"


class GGUFFile(GGUFReader):
    """gguf-py's reader of a GGUF file over a plain array view of its memory map. Its header parse
    slices the map a few times per vocabulary string, and a slice of an ``np.memmap`` runs Python
    (``__array_finalize__``) where a plain array's does not: Gemma 3's 262,144 tokens took 8.5 s to
    parse, 2.2 s so (an AMD EPYC Zen 5). Tensors read as plain arrays over the same map."""

    def __init__(self, path: str, mode: str = "r"):
        self.path = os.fspath(path)
        super().__init__(path, mode)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ sets it to the memory map
        self._data = value.view(np.ndarray)


# transformers' GGUF loading reads the module attribute gguf.GGUFReader: one stand-in at a time.
_PARSED_ONCE_LOCK = threading.RLock()


@contextlib.contextmanager
def parsed_once(reader: GGUFFile) -> Iterator[None]:
    """A context in which transformers' GGUF loading of ``reader.path`` reads ``reader`` (its parse)
    instead of parsing the file's header again (it does once each for config, tensors and
    tokenizer); any other file, or the same one opened in another mode, it reads anew."""
    with _PARSED_ONCE_LOCK:
        original = gguf.GGUFReader

        class ParsedOnce(original):  # a class, so that isinstance(x, gguf.GGUFReader) still works meanwhile
            def __new__(cls, path: str, *args: Any, **kwargs: Any) -> GGUFReader:
                if not args and not kwargs and os.path.samefile(path, reader.path):
                    return reader  # not a ParsedOnce: __init__ is not called on it
                return original(path, *args, **kwargs)

        gguf.GGUFReader = ParsedOnce
        try:
            yield
        finally:
            gguf.GGUFReader = original


def _write_folder(source: str, out_dir: str) -> None:
    """Write config, weights, tokenizer and generation config of the GGUF `source` into `out_dir`."""
    reader = GGUFFile(source)
    architecture = _field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} of {source} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if _field(reader, "tokenizer.ggml.model", None) is None:
        raise ValueError(f"GGUF file {source} has no tokenizer (metadata key 'tokenizer.ggml.model')")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = _build_config(reader, architecture, tensor_names)
    tensors = _convert_tensors(reader, architecture, config)
    _check_complete(tensors, config, architecture)

    _write_json(os.path.join(out_dir, "config.json"), config)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    generation_config = {
        key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config
    }
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config)
    _save_tokenizer(source, out_dir, reader)


def _field(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {reader.path} has no metadata key {key!r}")
        return default
    return field.contents()


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _build_config(reader: GGUFFile, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face config.json of the GGUF's model."""
    hidden_size = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length", None)
    if head_dim is None:
        head_dim = _field(reader, f"{arch}.rope.dimension_count", hidden_size // num_heads)
    embedding = next((tensor for tensor in reader.tensors if tensor.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"GGUF file {reader.path} has no token embedding tensor 'token_embd.weight'")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[arch]],
        "model_type": _HF_MODEL_TYPE[arch],
        "hidden_size": hidden_size,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": _float32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        # ggml lists dimensions fastest first: (hidden_size, vocab_size) for the embedding.
        "vocab_size": int(embedding.shape[-1]),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            config[hf_key] = int(token_id)
    return config


def _gemma3_config(reader: GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own config.json keys. The score scale is 1/√head_dim except for the 27B model
    (1/√(hidden_size / heads)), as llama.cpp decides it."""
    layers = config["num_hidden_layers"]
    scalar = config["head_dim"]
    if layers == _GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    softcap = _field(reader, "gemma3.final_logit_softcapping", None)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(_field(reader, "gemma3.attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN else "full_attention" for i in range(layers)
        ],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None if softcap is None else _float32(softcap),
        "attn_logit_softcapping": None,
    }


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"GGUF rope scaling type {kind!r} is not supported; supported: {', '.join(_ROPE_SCALING_TYPES)}"
        )
    if kind == "none":
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": _float32(_field(reader, f"{arch}.rope.scaling.factor")),
    }
    if kind == "yarn":
        original = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"{arch}.rope.scaling.{gguf_key}", None)
            if value is not None:
                scaling[hf_key] = _float32(value)
    return scaling


def _hf_tensor_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    block_names = _BLOCK_NAMES_BY_ARCH[arch]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, leaf = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and leaf in block_names:
        return f"model.layers.{layer}.{block_names[leaf]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart for architecture {arch!r}; "
        f"known tensors: {', '.join(_TOP_LEVEL_NAMES)} and blk.N.{{{', '.join(block_names)}}}"
    )


def _convert_tensors(reader: GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every GGUF tensor under its Hugging Face name, dequantized to float32, Q/K rows restored."""
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor"):
        name = _hf_tensor_name(tensor.name, arch)
        # A copy: the reader's data is a read-only view of the memory-mapped file.
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # [out, in] or [n]
        if arch in _PERMUTED_QK_ARCHS and name.endswith("self_attn.q_proj.weight"):
            weight = _unpermute_qk(weight, config["num_attention_heads"])
        elif arch in _PERMUTED_QK_ARCHS and name.endswith("self_attn.k_proj.weight"):
            weight = _unpermute_qk(weight, config["num_key_value_heads"])
        elif arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
            weight -= 1.0
        tensors[name] = weight
    return tensors


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of a Q or K projection.

    Hugging Face rotates row j of a head with row j + head_dim/2; llama.cpp rotates adjacent rows, so
    its converter moves Hugging Face row h·head_dim/2 + j of each head to row 2j + h. Reading each
    head as [head_dim/2, 2] rows and swapping the two axes puts them back.
    """
    rows, in_features = weight.shape  # [num_heads * head_dim, hidden_size]
    if rows % (2 * num_heads) != 0:
        raise ValueError(f"Q/K projection with {rows} rows does not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    heads = weight.reshape(num_heads, half, 2, in_features)
    return np.ascontiguousarray(heads.transpose(0, 2, 1, 3)).reshape(rows, in_features)


def _check_complete(tensors: dict[str, np.ndarray], config: dict[str, Any], arch: str) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    leaves = _BLOCK_NAMES_BY_ARCH[arch].values()
    expected.update(f"model.layers.{i}.{leaf}" for i in range(config["num_hidden_layers"]) for leaf in leaves)
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")


def _save_tokenizer(source: str, out_dir: str, reader: GGUFFile) -> None:
    """tokenizer.json and tokenizer_config.json from transformers' own GGUF tokenizer conversion.

    Going through transformers once (the result is cached) makes tpspec tokenize exactly as
    transformers does for this file. transformers 5 puts the chat template in chat_template.jinja;
    here it moves into tokenizer_config.json with add_bos_token/add_eos_token, which
    `tpspec.tokenizer.Tokenizer` reads.
    """
    from transformers import AutoTokenizer  # slow to import, and only needed on a cache miss

    logger.info("Converting the tokenizer of %s with transformers", source)
    directory, filename = os.path.split(source)
    with parsed_once(reader):  # transformers parses the file's header again otherwise
        hf_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    hf_tokenizer.save_pretrained(out_dir)

    template_path = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(template_path):
        os.remove(template_path)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    for key in ("is_local", "local_files_only"):  # describe this conversion run, not the tokenizer
        tokenizer_config.pop(key, None)
    tokenizer_config["add_bos_token"] = bool(getattr(hf_tokenizer, "add_bos_token", False))
    tokenizer_config["add_eos_token"] = bool(getattr(hf_tokenizer, "add_eos_token", False))
    if hf_tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = hf_tokenizer.chat_template
    _write_json(config_path, tokenizer_config)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
