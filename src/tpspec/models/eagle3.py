"""EAGLE-3 draft head (Li et al. 2025), in the public checkpoint format of the EAGLE repository
(also read by vLLM and SGLang).

The head fuses target hidden states from three layers with ``fc`` (n·H_t → H, no bias), runs one
Llama decoder layer (``midlayer``) whose attention reads ``cat(input_layernorm(embed),
hidden_norm(hidden))`` (2H inputs), and scores a reduced draft vocabulary with its own
``lm_head``; draft id i is target id ``i + d2t[i]``. The token embedding is the target's, unless the
checkpoint ships ``embed_tokens``.

Checkpoint keys: ``fc.weight``, ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}`` (``layers.0.`` is read as ``midlayer.``),
``norm.weight``, ``lm_head.weight``, ``d2t`` (int64, [draft_vocab_size]), optional
``embed_tokens.weight``; ``t2d`` is skipped. Config: a Llama ``config.json`` with one hidden layer,
``vocab_size`` = the target's, plus ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids`` and ``norm_before_residual`` (optional, as in vLLM).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tpspec.config import ModelArchConfig, read_config_json
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size, single_rank
from tpspec.layers.argmax import argmax_rows
from tpspec.layers.attention import AttentionMetadata
from tpspec.layers.linear import QKVParallelLinear, ReplicatedLinear
from tpspec.layers.logits import LogitsProcessor
from tpspec.layers.norm import RMSNorm
from tpspec.layers.partition import head_partition
from tpspec.layers.rotary import RopeAngles, RotaryEmbedding
from tpspec.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tpspec.models import layer_plans
from tpspec.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tpspec.models.weights import checkpoint_target
from tpspec.sample import token_bitmask

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 checkpoint's ``config.json``."""

    arch: ModelArchConfig  # the midlayer's shape; arch.vocab_size is the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int  # width of each fused target hidden state
    # Hugging Face ``hidden_states`` indices (id j = the input of target layer j), in fc order;
    # None = the EAGLE-3 default (2, N // 2, N - 3) for a target with N layers.
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool  # the midlayer's residual is hidden_norm(hidden) instead of hidden

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "Eagle3Config":
        arch = ModelArchConfig.from_hf_config(cfg)
        if arch.architecture not in EAGLE3_ARCHITECTURES:
            raise ValueError(
                f"EAGLE-3 config.json architectures must be one of {list(EAGLE3_ARCHITECTURES)}, "
                f"got {arch.architecture!r}"
            )
        if arch.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 config.json num_hidden_layers must be 1 (one midlayer), got {arch.num_hidden_layers}"
            )
        draft_vocab = cfg.get("draft_vocab_size") or arch.vocab_size
        if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 0 < draft_vocab <= arch.vocab_size:
            raise ValueError(
                f"EAGLE-3 config.json draft_vocab_size must be an integer in [1, vocab_size={arch.vocab_size}], "
                f"got {draft_vocab!r}"
            )
        target_hidden = cfg.get("target_hidden_size") or arch.hidden_size
        if isinstance(target_hidden, bool) or not isinstance(target_hidden, int) or target_hidden < 1:
            raise ValueError(f"EAGLE-3 config.json target_hidden_size must be a positive integer, got {target_hidden!r}")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (
            not isinstance(ids, list) or not ids or any(isinstance(j, bool) or not isinstance(j, int) for j in ids)
        ):
            raise ValueError(
                f"EAGLE-3 config.json eagle_aux_hidden_state_layer_ids must be a non-empty list of integers, got {ids!r}"
            )
        norm_first = cfg.get("norm_before_residual", False)
        if not isinstance(norm_first, bool):
            raise ValueError(f"EAGLE-3 config.json norm_before_residual must be true or false, got {norm_first!r}")
        return cls(arch, draft_vocab, target_hidden, None if ids is None else tuple(ids), norm_first)

    @classmethod
    def from_folder(cls, folder: str) -> "Eagle3Config":
        return cls.from_hf_config(read_config_json(folder, "EAGLE-3 folder"))

    def fc_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layer ids (tpspec convention: the output of layer L) whose hidden states ``fc``
        takes, in fc order. EAGLE id j, the input of layer j, is the output of layer j - 1."""
        n = num_target_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, n // 2, n - 3)
        bad = [j for j in ids if not 1 <= j <= n - 1]
        if bad:
            where = "" if self.aux_layer_ids is not None else f" (the default (2, N//2, N-3) for N={n}; set it in config.json)"
            raise ValueError(
                f"EAGLE-3 eagle_aux_hidden_state_layer_ids{where} must lie in [1, {n - 1}] for a target with "
                f"{n} layers (id j = the input of layer j; 0, the embedding output, is not supported), got {list(ids)}"
            )
        return tuple(j - 1 for j in ids)

    def validate(self, target: ModelArchConfig, ships_embedding: bool) -> None:
        """Raise ValueError if this head cannot draft for ``target``."""
        a = self.arch
        if a.vocab_size != target.vocab_size:
            raise ValueError(
                f"EAGLE-3 config.json vocab_size ({a.vocab_size}) must equal the target's vocab_size ({target.vocab_size})"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"EAGLE-3 config.json target_hidden_size ({self.target_hidden_size}) must equal the target's "
                f"hidden_size ({target.hidden_size})"
            )
        if not ships_embedding and a.hidden_size != target.hidden_size:
            raise ValueError(
                f"EAGLE-3 hidden_size ({a.hidden_size}) differs from the target's ({target.hidden_size}): the "
                f"checkpoint must ship its own embed_tokens.weight"
            )
        self.fc_layers(target.num_hidden_layers)


class Eagle3DecoderLayer(nn.Module):
    """The midlayer: a Llama decoder layer whose attention input is
    ``cat(input_layernorm(embeds), hidden_norm(hidden))`` [num_tokens, 2H]."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, norm_before_residual: bool):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm=False)
        # Same head split as the H-input projection it replaces, so o_proj and the KV heads still match.
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, dtype
        )
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        rope: RopeAngles,  # of the tokens' positions
        embeds: torch.Tensor,  # [num_tokens, H]
        hidden: torch.Tensor,  # [num_tokens, H]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual), both [num_tokens, H]; their sum is the layer's output."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [num_tokens, 2H]
        x = self.self_attn(rope, x, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _shape(tensor) -> tuple[int, ...]:
    """Shape of a safetensors slice or a tensor."""
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)


class Eagle3LlamaForCausalLM(nn.Module):
    """``combine_hidden_states(target features) -> h``; ``forward(next tokens, positions, h) ->
    (normed, prenorm)``, where prenorm is the next step's h and normed goes to ``compute_logits`` /
    ``get_top_tokens``, which answer in target token ids.

    TP layout: ``fc`` is replicated; the midlayer is head/column/row-split over the TP group, or
    whole on every rank with ``replicated`` (built and run under ``single_rank``); the embedding
    (the target's) and the draft LM head are always vocab-split over the TP group, so greedy
    drafting gathers (value, id) pairs, not draft-vocab logits.
    """

    use_layer_plans = True  # float32 CPU passes through the midlayer's plan (models/layer_plans.py)

    def __init__(
        self,
        cfg: Eagle3Config,
        target: ModelArchConfig,
        target_embed: VocabParallelEmbedding | None,  # None: the checkpoint ships embed_tokens
        dtype: torch.dtype = torch.float32,
        replicated: bool = False,
    ):
        super().__init__()
        cfg.validate(target, ships_embedding=target_embed is None)
        a = cfg.arch
        self.config = cfg
        self.dtype = dtype
        self.replicated = replicated
        self.vocab_size = a.vocab_size
        self.fc_layers = cfg.fc_layers(target.num_hidden_layers)
        if target_embed is None:
            self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype)
        else:
            self._borrowed = (target_embed,)  # the target's, not a submodule: its weights are not ours to load
        with self._body():
            self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
            self.fc = ReplicatedLinear(len(self.fc_layers) * cfg.target_hidden_size, a.hidden_size, False, dtype)
            self.midlayer = Eagle3DecoderLayer(a, dtype, cfg.norm_before_residual)
            self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
            _, (k0, k1) = head_partition(a.num_attention_heads, a.num_key_value_heads, get_tp_size(), get_tp_rank())
        self.kv_cache_shape = (k1 - k0, a.head_dim)  # per slot, one layer
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, a.hidden_size, dtype)
        self.logits_processor = LogitsProcessor(cfg.draft_vocab_size)
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab_size), persistent=False)  # [draft_vocab] i + d2t[i]
        self._midlayer_plan: layer_plans.LayerPlans | None = None  # [plan] or [] (none), built on first use

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return self.embed_tokens if hasattr(self, "embed_tokens") else self._borrowed[0]

    def _body(self):
        """The TP context of fc, midlayer and norm."""
        return single_rank() if self.replicated else contextlib.nullcontext()

    def combine_hidden_states(self, features: torch.Tensor) -> torch.Tensor:
        """features: [num_tokens, n·H_t], target hidden states in ``fc_layers`` order -> [num_tokens, H]."""
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] the token after each row's position
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, H] fused target features, or the previous step's prenorm
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed [num_tokens, H] for the LM head, prenorm [num_tokens, H] for the next step)."""
        embeds = self.embedding(input_ids)  # [num_tokens, H], vocab-split: one all-reduce
        with self._body():
            rope = self.rotary.angles(positions, self.dtype)
            plan = self._plan(embeds, hidden, kv_cache)
            out, residual = (plan or self.midlayer)(rope, embeds, hidden, kv_cache, md)
            return self.norm(out, residual)

    def _plan(self, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache) -> layer_plans.Eagle3MidlayerPlan | None:
        """The midlayer's plan of kernel calls for this pass (``layer_plans``), None where it takes its modules."""
        if not (self.use_layer_plans and layer_plans.step_fits(hidden, [kv_cache]) and embeds.is_contiguous()):
            return None
        if self._midlayer_plan is None or not self._midlayer_plan.current():
            self._midlayer_plan = layer_plans.build([self.midlayer], layer_plans.Eagle3MidlayerPlan)
        return self._midlayer_plan[0] if self._midlayer_plan else None

    def compute_logits(self, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [num_rows, H] -> [num_rows, vocab_size] float32 over the target vocabulary:
        the draft-vocab logits at their target ids, -inf elsewhere."""
        draft = self.logits_processor.compute_logits(self.lm_head, hidden, site)  # [num_rows, draft_vocab]
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, draft)

    def greedy_tokens(
        self, hidden: torch.Tensor, site: str = "logits.all_gather", bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [num_rows, H] -> [num_rows] int64 target ids: the argmax of the gathered
        draft-vocab logits, equal to ``compute_logits(hidden).argmax(-1)`` (target ids ascend with
        draft ids, so ties agree; a row of all -inf logits aside) without filling a full-vocabulary
        row. ``bitmask`` ([num_rows, words] over target ids): the argmax of the allowed ones."""
        logits = self.logits_processor.compute_logits(self.lm_head, hidden, site)  # [num_rows, draft_vocab]
        token_bitmask.apply(logits, bitmask, self.target_ids, argmax_only=True)
        return self.target_ids[argmax_rows(logits)]

    def get_top_tokens(
        self, hidden: torch.Tensor, site: str = "draft.sample", bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [num_rows, H] -> [num_rows] int64 target ids, equal to
        ``compute_logits(hidden).argmax(-1)`` (target ids ascend with draft ids, so ties agree; of
        the target ids ``bitmask`` allows), gathering 8·tp bytes per row."""
        draft_ids = self.logits_processor.get_top_tokens(self.lm_head, hidden, site, bitmask, self.target_ids)
        return self.target_ids[draft_ids]

    # ---- loading ------------------------------------------------------------------------------
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        a, cfg = self.config.arch, self.config
        return {
            "fc.weight": (a.hidden_size, len(self.fc_layers) * cfg.target_hidden_size),
            "lm_head.weight": (cfg.draft_vocab_size, a.hidden_size),
            "embed_tokens.weight": (a.vocab_size, a.hidden_size),
            "d2t": (cfg.draft_vocab_size,),
        }

    def _load_d2t(self, loaded) -> None:
        target_ids = torch.arange(self.config.draft_vocab_size) + loaded[:].to(torch.int64)  # [draft_vocab]
        increasing = bool((target_ids[1:] > target_ids[:-1]).all())
        if not increasing or target_ids.min() < 0 or target_ids.max() >= self.vocab_size:
            raise ValueError(
                f"EAGLE-3 d2t must map draft ids to strictly increasing target ids in [0, {self.vocab_size}) "
                f"(draft id i -> i + d2t[i]); got target ids from {target_ids.min().item()} to "
                f"{target_ids.max().item()}, increasing: {increasing}"
            )
        self.target_ids.copy_(target_ids)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load (checkpoint name, sliceable tensor) pairs; raises ValueError on an unknown name, a
        wrong shape or a missing tensor. Returns the names loaded (``d2t`` included)."""
        expected = self._expected_shapes()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "t2d":  # target -> draft membership mask: not needed to draft
                continue
            if name.startswith("layers.0."):
                name = "midlayer." + name[len("layers.0.") :]
            if name in expected and _shape(tensor) != expected[name]:
                raise ValueError(
                    f"EAGLE-3 checkpoint tensor {name} has shape {list(_shape(tensor))}, expected {list(expected[name])}"
                )
            if name == "d2t":
                self._load_d2t(tensor)
                loaded.add(name)
                continue
            pname, module, param, shard = checkpoint_target(self, name, LlamaForCausalLM.packed)
            module.weight_loader(param, tensor, shard)
            loaded.add(pname)
        required = {n for n, _ in self.named_parameters()}
        if self.config.draft_vocab_size < self.vocab_size:
            required.add("d2t")
        missing = sorted(required - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint lacks tensors: {missing[:5]}")
        return loaded
