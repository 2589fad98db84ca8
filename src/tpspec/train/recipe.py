"""What ``tpspec train-draft`` is told: the drafter and its data (``DraftRecipe``) and the
optimization (``TrainConfig``). No torch here: the command line reads its defaults from these."""

from __future__ import annotations

from dataclasses import dataclass


LOSS_VOCABS = ("full", "labels")
TRAIN_METHODS = ("dflash", "eagle3", "mtp")
# "auto": bfloat16 where the CPU multiplies it natively (cpu_features.BFLOAT16_ISA; 2.5x a float32
# EAGLE-3 step on AVX512-BF16, benchmarks/README.md), else none (float32 throughout)
AUTOCAST_OPTIONS = ("auto", "bfloat16", "none")
FEATURE_DTYPES = ("float32", "float16", "bfloat16")
# where every stage runs (generation, target features, training): "auto" is CUDA when available
TRAIN_DEVICES = ("auto", "cpu", "cuda")
# where training prompts and real text come from: the standard library, the installed packages' sources
CODE_SOURCES = ("stdlib", "site-packages")


@dataclass(frozen=True)
class DraftRecipe:
    method: str = "dflash"
    # dflash: the draft layers and the target layers they read
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None  # None: evenly spread over the target
    block_size: int = 16
    mask_token_id: int | None = None  # None: the last id of the target's vocabulary
    init_from_target: bool = True  # dflash, mtp: draft layers start as copies of the target's last layers
    # eagle3: the draft vocabulary; the target layers read are EAGLE-3's default (2, N // 2, N − 3)
    # unless target_layer_ids names them (tpspec convention: the output of layer L)
    draft_vocab_size: int = 16384
    # eagle3, mtp: the chain steps trained per position (training-time test)
    chain_depth: int = 6
    code_sources: tuple[str, ...] = ("stdlib",)  # of the prompts and the real text, in order (CODE_SOURCES)
    num_prompts: int | None = 512  # training prompts whose continuations are generated (None: all)
    max_tokens: int = 128  # continuation length per prompt
    text_tokens: int = 131_072  # real-text tokens (0: none)
    generation_dtype: str = "auto"  # the engine's --dtype: float32 on CPU, bfloat16 on CUDA
    # the target forward that makes features and labels (float16: 1.5x float32 on AVX-512 with
    # 99.8 % of argmax labels equal; bfloat16 2x with 98.3 %; benchmarks/README.md)
    feature_dtype: str = "float32"
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.method not in TRAIN_METHODS:
            raise ValueError(f"train-draft method must be one of {TRAIN_METHODS}, got {self.method!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"draft recipe feature_dtype must be one of {FEATURE_DTYPES}, got {self.feature_dtype!r}")
        if self.method == "mtp" and self.target_layer_ids is not None:
            raise ValueError(f"draft recipe target_layer_ids does not apply to method 'mtp' (it reads the target's "
                             f"final-norm output), got {self.target_layer_ids!r}")
        sources = self.code_sources
        if not sources or any(c not in CODE_SOURCES for c in sources) or len(set(sources)) < len(sources):
            raise ValueError(f"draft recipe code_sources must be distinct names from {CODE_SOURCES}, got {self.code_sources!r}")
        for name in ("num_layers", "block_size", "draft_vocab_size", "chain_depth", "max_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"draft recipe {name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    seqs_per_step: int = 8
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    loss_decay_gamma: float = 5.0
    # The loss's softmax over the "full" vocabulary, or over the "labels": the tokens the target
    # predicts somewhere in the training data (every label is one; far cheaper at a large vocabulary;
    # held-out acceptance is always scored over the full vocabulary).
    loss_vocab: str = "full"
    autocast: str = "auto"  # the training forward and backward's matrix products (AUTOCAST_OPTIONS)
    grad_clip: float = 1.0
    device: str = "auto"  # TRAIN_DEVICES
    checkpoint_every: int = 100
    eval_every: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "checkpoint_every", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"train config {name} must be a positive integer, got {v!r}")
        if self.loss_vocab not in LOSS_VOCABS:
            raise ValueError(f"train config loss_vocab must be one of {LOSS_VOCABS}, got {self.loss_vocab!r}")
        if self.device not in TRAIN_DEVICES:
            raise ValueError(f"train config device must be one of {TRAIN_DEVICES}, got {self.device!r}")
        if self.autocast not in AUTOCAST_OPTIONS:
            raise ValueError(f"train config autocast must be one of {AUTOCAST_OPTIONS}, got {self.autocast!r}")
        if not self.lr > 0:
            raise ValueError(f"train config lr must be > 0, got {self.lr!r}")
