"""Shared fixtures: tiny random Llama, Qwen3 and Gemma 3 checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
import os

import pytest

# Under pytest-xdist (make test) two workers share the two cores: one intra-op thread each, for
# this process and the TP workers it starts (threads_per_rank reads OMP_NUM_THREADS).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# The longest files first (they would otherwise finish last, on one worker, while the other idles):
# each is scheduled as a whole (--dist loadfile) in this order, the rest in collection order. By
# their time under two workers in a clean clone (test_torch_compile.py compiles its graphs there:
# ~30 s alone with an empty inductor cache, ~10 s with a warm one).
LONGEST_FILES = (
    "tests/models/test_gemma3.py",
    "tests/engine/test_torch_compile.py",
    "tests/spec_decode/test_spec_engine.py",
    "tests/engine/speculation/test_speculation_length.py",
    "tests/spec_decode/test_shipped_drafters.py",
    "tests/structured/test_default_model.py",
    "tests/structured/test_structured_engine.py",
    "tests/train/test_train_draft.py",
    "tests/layers/test_get_top_tokens.py",
    "tests/distributed/test_tp_generation.py",
    "tests/spec_decode/test_rejection_sampler.py",
)

SERIAL_MARK = "pytest.mark.serial"


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """Under ``-m serial`` alone (make test's second run), a test file that never names the serial
    marker is not imported: collecting every file (imports, assertion rewriting) took 7 s of a
    serial part that runs with one core idle."""
    if config.getoption("markexpr") != "serial" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return SERIAL_MARK not in collection_path.read_text(encoding="utf-8") or None


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file keeps its own order

TINY = dict(
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=6,  # uneven at TP 4 (2, 2, 1, 1): exercises the uneven head split
    num_key_value_heads=2,
    vocab_size=1000,  # padded to 1024: exercises vocab padding on the last shard
    max_position_embeddings=512,
    initializer_range=0.15,  # peaky logits: greedy decisions far from ties
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nfor i in range(10):\n    print(i)\n",
    "Tensor parallelism splits the vocabulary across ranks.",
] * 50


def write_tokenizer(folder: str, vocab_size: int = 400) -> None:
    """A small byte-level BPE tokenizer trained on a fixed corpus, plus a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": template,
             "tokenizer_class": "PreTrainedTokenizerFast"},
            f,
        )


def _write_tiny(folder: str, arch: str, **overrides) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    kw = dict(TINY, **overrides)
    if arch in ("qwen3", "gemma3"):
        kw.setdefault("head_dim", 16)
    if arch == "gemma3":
        kw = {**TINY_GEMMA3, **kw}
    model = model_cls(cfg_cls(**kw)).eval()
    if arch == "gemma3":  # Gemma initializes its norms to w = 0 (scale 1 + w = 1): make the + 1 matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return _write_tiny(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def tiny_llama_whole_groups(tmp_path_factory) -> str:
    """A tiny Llama whose TP 2 shards split every weight into whole 32-input groups (Q4_1's and the
    integer kernels' activation groups): hidden 128, 8 heads of 16, MLP 256."""
    return _write_tiny(str(tmp_path_factory.mktemp("tiny-llama-whole-groups")), "llama", hidden_size=128,
                       intermediate_size=256, num_attention_heads=8)


def exactly_q4_1(v, g):
    """A random weight of ``v``'s shape that is exactly Q4_1 (per 32 inputs, w = d·q + m, as llama.cpp
    rounds: the minimum is m, the maximum d·15 + m) with d a power of two and m a multiple of d, so
    that it is exactly float16 too."""
    import torch

    groups = v.shape[1] // 32
    d = 2.0 ** -torch.randint(5, 8, (v.shape[0], groups, 1), generator=g)
    m = -torch.randint(0, 12, (v.shape[0], groups, 1), generator=g) * d
    q = torch.randint(0, 16, (v.shape[0], groups, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).flatten(1).float()


def copy_with_weights(source: str, folder: str, weights: dict) -> str:
    """``source``'s model folder copied to ``folder`` with ``weights`` as its checkpoint."""
    import shutil

    from safetensors.torch import save_file

    for name in os.listdir(source):
        if name != "model.safetensors":
            shutil.copy(os.path.join(source, name), folder)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_gguf_llama(tiny_llama_whole_groups, tmp_path_factory) -> str:
    """tiny_llama_whole_groups as a Q4_1 GGUF holds its weights (the default model's): the layers
    exactly Q4_1 (``exactly_q4_1``), the LM head exactly Q8_0 (d a power of two, some |q| = 127 in each
    group): every linear weight runs through the integer kernels under w4a16 and w4a8."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(tiny_llama_whole_groups, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k, v in weights.items():
        if k.endswith("proj.weight"):
            weights[k] = exactly_q4_1(v, g)
        elif k == "lm_head.weight":
            groups = v.shape[1] // 32
            d = 2.0 ** -torch.randint(6, 8, (v.shape[0], groups, 1), generator=g)
            q = torch.randint(-127, 128, (v.shape[0], groups, 32), generator=g)
            q[..., 0] = 127
            weights[k] = (d * q).flatten(1).float()
    return copy_with_weights(tiny_llama_whole_groups, str(tmp_path_factory.mktemp("tiny-gguf-llama")), weights)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> str:
    return _write_tiny(str(tmp_path_factory.mktemp("tiny-llama-tied")), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return _write_tiny(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3")


# Gemma 3's own features, each away from its neutral value: a window shorter than the test
# prompts, local and global layers with different RoPE bases, a score scale other than 1/√head_dim,
# and a final soft cap the logits reach.
TINY_GEMMA3 = dict(
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=24,
    final_logit_softcapping=3.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return _write_tiny(str(tmp_path_factory.mktemp("tiny-gemma3")), "gemma3")


TINY_DFLASH = dict(num_layers=2, target_layer_ids=(0, 2), block_size=6, mask_token_id=999)


def write_tiny_dflash(folder: str, target_folder: str, seed: int = 0, scale: float = 3.0) -> str:
    """A random DFlash checkpoint (public layout, float32) for the tiny Llama target; ``scale``
    multiplies the default init so the drafter's outputs are not all near-ties."""
    import torch

    from tpspec.config import ModelArchConfig
    from tpspec.train.dflash_module import DFlashTrainModel
    from tpspec.train.dflash_trainer import new_dflash_config

    torch.manual_seed(seed)
    cfg = new_dflash_config(ModelArchConfig.from_folder(target_folder), **TINY_DFLASH)
    model = DFlashTrainModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="session")
def tiny_dflash(tiny_llama, tmp_path_factory) -> str:
    return write_tiny_dflash(str(tmp_path_factory.mktemp("tiny-dflash")), tiny_llama)


@pytest.fixture(params=["torch-ops", "cpu-kernels"])
def cpu_kernels_mode(request, monkeypatch) -> str:
    """Runs a test with tpspec's CPU kernels (layers.cpu_kernels) unloaded, then loaded, whatever
    earlier tests built: the layers with a PyTorch path take the kernels only when loaded."""
    from tpspec.layers import cpu_kernels

    if request.param == "cpu-kernels":
        reason = cpu_kernels.unavailable()
        if reason:
            pytest.skip(f"tpspec's CPU kernels are unavailable here: {reason}")
        monkeypatch.setattr(cpu_kernels, "_MODULE", cpu_kernels.kernels())
    else:
        monkeypatch.setattr(cpu_kernels, "_MODULE", None)
    return request.param
