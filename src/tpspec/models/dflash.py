"""DFlash draft model (z-lab's block-diffusion drafter) in its public checkpoint format.

A few Qwen3-style decoder layers with no embedding or LM head of their own: they borrow the
target's. The target's hidden states at ``target_layer_ids`` are concatenated, projected by
``fc`` (n·H → H, no bias) and ``hidden_norm``; these context features enter every layer as extra
keys and values (through that layer's own k_proj/v_proj, k_norm and RoPE at the context
positions) and are not updated layer to layer. The draft block ``[last token, MASK × (L − 1)]``
attends to the context and, non-causally, to itself; block output j predicts the token at block
position j (no shift), so one forward yields L − 1 drafts.

Here the context K/V are written once into the draft's paged KV cache (``write_context``), at the
target's slots, and the block runs as ordinary decoder layers over that cache (``forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tpspec.config import ModelArchConfig, read_config_json
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.cpu_weights import linear
from tpspec.layers.linear import ReplicatedLinear
from tpspec.layers.norm import RMSNorm
from tpspec.layers.partition import head_partition
from tpspec.layers.rotary import RotaryEmbedding
from tpspec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tpspec.models.weights import checkpoint_target

DFLASH_ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash checkpoint's ``config.json``: the draft layers' shape plus the DFlash keys."""

    arch: ModelArchConfig  # the draft layers (hidden_size = the target's)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    @classmethod
    def from_folder(cls, folder: str) -> "DFlashConfig":
        cfg = read_config_json(folder, "DFlash checkpoint")
        dflash = cfg.get("dflash_config") or {}
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        missing += [k for k in ("block_size", "num_target_layers") if k not in cfg]
        if missing:
            raise ValueError(f"DFlash checkpoint {folder!r}: config.json lacks {missing} (dflash_config.* / top level)")
        arch = ModelArchConfig.from_hf_config({**cfg, "architectures": [DFLASH_ARCHITECTURE]})
        return cls(arch, int(cfg["block_size"]), int(dflash["mask_token_id"]),
                   tuple(int(i) for i in dflash["target_layer_ids"]), int(cfg["num_target_layers"]))

    def validate(self, target: ModelArchConfig, num_speculative_tokens: int) -> None:
        """Raise ValueError if this drafter cannot serve ``target`` with k draft tokens."""
        if self.arch.hidden_size != target.hidden_size:
            raise ValueError(
                f"DFlash hidden_size ({self.arch.hidden_size}) differs from the target's ({target.hidden_size})"
            )
        if self.num_target_layers != target.num_hidden_layers:
            raise ValueError(
                f"DFlash num_target_layers ({self.num_target_layers}) differs from the target's "
                f"num_hidden_layers ({target.num_hidden_layers}): it was trained for another model"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"DFlash dflash_config.target_layer_ids {list(self.target_layer_ids)} must be non-empty layer ids "
                f"in [0, {target.num_hidden_layers})"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"DFlash mask_token_id {self.mask_token_id} is outside the target's vocab [0, {target.vocab_size})")
        if num_speculative_tokens > self.block_size - 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={num_speculative_tokens} exceeds what this DFlash "
                f"drafter yields per forward (block_size - 1 = {self.block_size - 1})"
            )


class DFlashDraftModel(nn.Module):
    """``write_context`` stores the context K/V of every layer; ``forward`` runs a draft block.

    The target's embedding, LM head and logits processor are borrowed (never copied): the mask
    token is a row of the target's embedding table and ``get_top_tokens`` is the target's.
    """

    packed = LlamaForCausalLM.packed

    def __init__(self, cfg: DFlashConfig, target: LlamaForCausalLM, dtype: torch.dtype = torch.float32):
        super().__init__()
        a = cfg.arch
        self.config = cfg
        self.dtype = dtype
        self._borrowed = (target,)  # borrowed, not a submodule: its weights are not ours to load
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        n = len(cfg.target_layer_ids)
        self.fc = ReplicatedLinear(n * a.hidden_size, a.hidden_size, False, dtype)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(a, dtype, qk_norm=True) for _ in range(a.num_hidden_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        _, (k0, k1) = head_partition(a.num_attention_heads, a.num_key_value_heads, get_tp_size(), get_tp_rank())
        self.kv_cache_shape = (k1 - k0, a.head_dim)  # per slot, per layer

    @property
    def target(self) -> LlamaForCausalLM:
        return self._borrowed[0]

    def write_context(
        self,
        features: torch.Tensor,  # [num_ctx, n·hidden_size] target hidden states at target_layer_ids
        positions: torch.Tensor,  # [num_ctx]
        slots: torch.Tensor,  # [num_ctx] KV cache slot of each context token
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """K/V of the context features, per layer: k_norm(k_proj(c)) with RoPE, v_proj(c), c = hidden_norm(fc(f))."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [num_ctx, hidden_size]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            attn = layer.self_attn
            p = attn.qkv_proj
            bias = None if p.bias is None else p.bias[p.q_size :]
            k, v = linear(ctx, p.weight[p.q_size :], bias).split([p.kv_size, p.kv_size], dim=-1)
            k = attn.k_norm(k.view(-1, p.num_local_kv_heads, p.head_dim))
            k = self.rotary.rotate(positions, k)
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.view(-1, p.num_local_kv_heads, p.head_dim).to(v_cache.dtype))

    def forward(
        self,
        input_embeds: torch.Tensor,  # [num_block_tokens, hidden_size] embeddings of the block tokens
        positions: torch.Tensor,  # [num_block_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md,  # AttentionMetadata: causal over the context, non-causal inside each block
    ) -> torch.Tensor:
        """Returns the final-norm hidden states of the block tokens [num_block_tokens, hidden_size]."""
        hidden, residual = input_embeds.to(self.dtype), None
        rope = self.rotary.angles(positions, self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [rows, hidden_size] -> [rows, vocab_size] float32, through the target's LM head."""
        return self.target.compute_logits(hidden, site)

    def compute_logits_shard(self, hidden: torch.Tensor):
        """hidden: [rows, hidden_size] -> this rank's columns of the target's logits (vocab-parallel sampling)."""
        return self.target.compute_logits_shard(hidden)

    def get_top_tokens(
        self, hidden: torch.Tensor, site: str = "draft.sample", bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [rows, hidden_size] -> [rows] int64, the target's vocab-parallel argmax (under ``bitmask``)."""
        return self.target.get_top_tokens(hidden, site, bitmask)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load (checkpoint name, sliceable tensor) pairs; returns the names of our parameters loaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            pname, module, param, shard = checkpoint_target(self, name, self.packed)
            module.weight_loader(param, tensor, shard)
            loaded.add(pname)
        return loaded
