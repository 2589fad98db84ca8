"""Multi-token prediction (MTP) modules in the DeepSeek-V3 checkpoint layout that vLLM reads
(``method: mtp``), for targets built of Llama-style decoder layers (Llama, Qwen3).

The checkpoint is the target's ``config.json`` plus ``num_nextn_predict_layers``, with MTP module i
at ``model.layers.{num_hidden_layers + i}``: ``enorm``, ``hnorm`` (RMSNorms), ``eh_proj`` (2H → H,
no bias), one decoder block of the target's kind (``input_layernorm``,
``self_attn.{q,k,v,o}_proj`` (+ ``q_norm``/``k_norm`` for Qwen3), ``post_attention_layernorm``,
``mlp.{gate,up,down}_proj``) and ``shared_head.{norm, head}``. Tensors outside the MTP layers (a
whole target checkpoint with its MTP layers) are skipped; so are the MTP layers' ``embed_tokens``:
the embedding is the target's. ``shared_head.head`` is optional (absent: the target's LM head); the
first MTP layer's head serves every layer.

Row t at position t: ``h = eh_proj(cat(enorm(embed(token t + 1)), hnorm(hidden at t)))``, then the
block; the block's output (pre-norm) is the next chain step's hidden, and ``shared_head.norm`` of it
goes to the LM head, predicting token t + 2. The first step's hidden is the target's final-norm
output (what vLLM hands MTP: the target model's output); as in vLLM, the embedding at position 0
is zeroed. Chain step j runs MTP layer j mod num_nextn_predict_layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tpspec.config import ModelArchConfig, read_config_json
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size, single_rank
from tpspec.layers.attention import AttentionMetadata
from tpspec.layers.linear import ReplicatedLinear
from tpspec.layers.logits import LogitsProcessor
from tpspec.layers.norm import RMSNorm
from tpspec.layers.partition import head_partition
from tpspec.layers.rotary import RopeAngles, RotaryEmbedding
from tpspec.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tpspec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tpspec.models.weights import checkpoint_target
from tpspec.sample.vocab_parallel import LogitsShard

# Architectures whose decoder layer an MTP block can be (the model class's qk_norm picks the kind).
MTP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# Per MTP layer, the tensors outside its decoder block (checkpoint sub-names).
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@dataclass(frozen=True)
class MTPConfig:
    """An MTP checkpoint's ``config.json``: the target's, plus ``num_nextn_predict_layers``."""

    arch: ModelArchConfig  # the target's shape; MTP layer i is model.layers.{arch.num_hidden_layers + i}
    num_nextn_predict_layers: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "MTPConfig":
        n = cfg.get("num_nextn_predict_layers")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"MTP config.json num_nextn_predict_layers must be a positive integer, got {n!r}")
        architecture = (cfg.get("architectures") or [None])[0]
        if architecture not in MTP_ARCHITECTURES:
            raise ValueError(
                f"MTP config.json architectures must be one of {list(MTP_ARCHITECTURES)} (Llama-style decoder "
                f"blocks), got {architecture!r}"
            )
        return cls(ModelArchConfig.from_hf_config(cfg), n)

    @classmethod
    def from_folder(cls, folder: str) -> "MTPConfig":
        return cls.from_hf_config(read_config_json(folder, "MTP folder"))

    @property
    def first_layer(self) -> int:
        """The checkpoint layer index of MTP module 0."""
        return self.arch.num_hidden_layers

    @property
    def qk_norm(self) -> bool:
        from tpspec.models.registry import get_model_class

        return get_model_class(self.arch.architecture).qk_norm

    def validate(self, target: ModelArchConfig) -> None:
        """Raise ValueError if these modules cannot draft for ``target``."""
        for field in ("vocab_size", "hidden_size"):
            if getattr(self.arch, field) != getattr(target, field):
                raise ValueError(
                    f"MTP config.json {field} ({getattr(self.arch, field)}) must equal the target's ({getattr(target, field)})"
                )


class MTPLayer(nn.Module):
    """One MTP module: ``eh_proj(cat(enorm(embeds), hnorm(hidden)))`` [num_tokens, 2H → H], a
    decoder block, and ``shared_head.norm`` of the block's output."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, dtype)
        self.mtp_block = LlamaDecoderLayer(cfg, dtype, qk_norm)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        rope: RopeAngles,  # of the tokens' positions
        embeds: torch.Tensor,  # [num_tokens, H]
        hidden: torch.Tensor,  # [num_tokens, H]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed for the LM head, prenorm for the next step), both [num_tokens, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = self.mtp_block(rope, x, None, kv_cache, md)
        return self.shared_head.norm(out, residual)


class MTPModel(nn.Module):
    """``forward(next tokens, positions, hidden, kv_cache, md, layer) -> (normed, prenorm)``;
    ``compute_logits`` / ``compute_logits_shard`` / ``get_top_tokens`` over the target vocabulary.

    TP layout: ``eh_proj`` and the norms are replicated; each block is head/column/row-split over
    the TP group, or whole on every rank with ``replicated`` (built and run under ``single_rank``);
    the embedding (the target's) and the LM head are vocab-split, so greedy drafting with
    ``use_local_argmax_reduction`` gathers (value, id) pairs, not logits.
    """

    def __init__(
        self,
        cfg: MTPConfig,
        target: ModelArchConfig,
        target_embed: VocabParallelEmbedding,
        target_lm_head: ParallelLMHead | None,  # None: the checkpoint ships shared_head.head
        dtype: torch.dtype = torch.float32,
        replicated: bool = False,
    ):
        super().__init__()
        cfg.validate(target)
        a = cfg.arch
        self.config = cfg
        self.dtype = dtype
        self.replicated = replicated
        self._borrowed = {"embed": target_embed}  # the target's, not submodules: not ours to load
        with self._body():
            self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
            self.layers = nn.ModuleList([MTPLayer(a, dtype, cfg.qk_norm) for _ in range(cfg.num_nextn_predict_layers)])
            _, (k0, k1) = head_partition(a.num_attention_heads, a.num_key_value_heads, get_tp_size(), get_tp_rank())
        self.kv_cache_shape = (k1 - k0, a.head_dim)  # per slot, per MTP layer
        if target_lm_head is None:
            self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, dtype)
        else:
            self._borrowed["lm_head"] = target_lm_head
        self.logits_processor = LogitsProcessor(a.vocab_size)

    @property
    def head(self) -> ParallelLMHead:
        return self.lm_head if "lm_head" not in self._borrowed else self._borrowed["lm_head"]

    def _body(self):
        """The TP context of the MTP layers."""
        return single_rank() if self.replicated else contextlib.nullcontext()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] the token after each row's position
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, H] the target's final-norm output, or the previous step's prenorm
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # this MTP layer's
        md: AttentionMetadata,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed [num_tokens, H] for the LM head, prenorm [num_tokens, H] for the next step)."""
        embeds = self._borrowed["embed"](input_ids)  # [num_tokens, H], vocab-split: one all-reduce
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)  # as vLLM: position 0 takes no token
        with self._body():
            return self.layers[layer](self.rotary.angles(positions, self.dtype), embeds, hidden, kv_cache, md)

    def compute_logits(self, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [num_rows, H] -> [num_rows, vocab_size] float32."""
        return self.logits_processor.compute_logits(self.head, hidden, site)

    def compute_logits_shard(self, hidden: torch.Tensor) -> LogitsShard:
        """hidden: [num_rows, H] -> this rank's logit columns [num_rows, shard_size]; no communication."""
        return self.logits_processor.compute_logits_shard(self.head, hidden)

    def get_top_tokens(
        self, hidden: torch.Tensor, site: str = "draft.sample", bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [num_rows, H] -> [num_rows] int64, equal to ``compute_logits(hidden).argmax(-1)``
        (of the tokens ``bitmask`` allows), gathering 8·tp bytes per row."""
        return self.logits_processor.get_top_tokens(self.head, hidden, site, bitmask)

    # ---- loading ------------------------------------------------------------------------------
    def _our_name(self, name: str) -> str | None:
        """A checkpoint name -> our parameter's path (None: not ours to load)."""
        prefix, first = "model.layers.", self.config.first_layer
        if not name.startswith(prefix):
            return None
        index, _, rest = name[len(prefix) :].partition(".")
        i = int(index) - first if index.isdigit() else -1
        if not 0 <= i < self.config.num_nextn_predict_layers or rest == "embed_tokens.weight":
            return None
        if rest == "shared_head.head.weight":
            return "lm_head.weight" if i == 0 and "lm_head" not in self._borrowed else None
        return f"layers.{i}.{rest}" if rest in _MTP_OWN else f"layers.{i}.mtp_block.{rest}"

    def _expected_shape(self, ours: str) -> tuple[int, ...] | None:
        """The checkpoint shape of our parameter path ``ours`` (None: not checked)."""
        a = self.config.arch
        h, d = a.hidden_size, a.head_dim
        q, kv, inter = a.num_attention_heads * d, a.num_key_value_heads * d, a.intermediate_size
        module = ours.split(".")[-2]  # eh_proj, q_proj, …, enorm, input_layernorm, q_norm, lm_head
        shapes = {"eh_proj": (h, 2 * h), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                  "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter), "q_norm": (d,),
                  "k_norm": (d,), "lm_head": (a.vocab_size, h)}
        return shapes.get(module, (h,) if module.endswith("norm") else None)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load (checkpoint name, sliceable tensor) pairs; raises ValueError on an unknown name in an
        MTP layer, a wrong shape or a missing tensor. Returns the names of our parameters loaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            ours = self._our_name(name)
            if ours is None:
                continue
            want = self._expected_shape(ours)
            shape = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
            if want is not None and shape != want:
                raise ValueError(f"MTP checkpoint tensor {name} has shape {list(shape)}, expected {list(want)}")
            pname, module, param, shard = checkpoint_target(self, ours, LlamaForCausalLM.packed)
            module.weight_loader(param, tensor, shard)
            loaded.add(pname)
        missing = sorted({n for n, _ in self.named_parameters()} - loaded)
        if missing:
            raise ValueError(
                f"MTP checkpoint lacks tensors (MTP layer i is model.layers.{self.config.first_layer} + i): {missing[:5]}"
            )
        return loaded


def ships_lm_head(weight_names: Iterable[str], cfg: MTPConfig) -> bool:
    """Whether the first MTP layer ships ``shared_head.head.weight``."""
    return f"model.layers.{cfg.first_layer}.shared_head.head.weight" in set(weight_names)
