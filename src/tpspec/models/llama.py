"""Llama-family decoder built from TP layers (also the base of Qwen3, which adds per-head q/k norm)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tpspec.config import ModelArchConfig
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers.activation import silu_and_mul
from tpspec.layers.attention import Attention, AttentionMetadata
from tpspec.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpspec.layers.logits import LogitsProcessor
from tpspec.layers.norm import RMSNorm
from tpspec.layers.partition import head_partition
from tpspec.layers.rotary import RopeAngles, RotaryEmbedding, apply_rope
from tpspec.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from tpspec.models import layer_plans
from tpspec.models.weights import checkpoint_target
from tpspec.sample.vocab_parallel import LogitsShard


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, dtype: torch.dtype, qk_norm: bool,
        scale: float | None = None, sliding_window: int | None = None,
    ):
        """``scale``, ``sliding_window``: as ``Attention``'s (defaults: 1/√head_dim, the whole context)."""
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, dtype)
        q0, q1 = self.qkv_proj.q_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, cfg.attention_bias, dtype, input_range=(q0 * d, q1 * d)
        )
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_of_head = torch.arange(q0, q1) // group - self.qkv_proj.kv_heads[0]
        self.attn = Attention(
            self.qkv_proj.num_local_heads, self.qkv_proj.num_local_kv_heads, d, kv_of_head, scale, sliding_window
        )
        self.q_norm = self._head_norm(cfg, dtype) if qk_norm else None
        self.k_norm = self._head_norm(cfg, dtype) if qk_norm else None

    @staticmethod
    def _head_norm(cfg: ModelArchConfig, dtype: torch.dtype) -> nn.Module:
        """The RMSNorm over each query / key head (Qwen3's)."""
        return RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, rope: RopeAngles, hidden, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2·kv_heads)·d]
        p = self.qkv_proj
        d = p.head_dim
        qk, v = qkv.split([p.q_size + p.kv_size, p.kv_size], dim=-1)
        v = v.view(-1, p.num_local_kv_heads, d)
        if self.q_norm is None:
            # Query and key heads side by side: one rotation for both.
            qk = apply_rope(qk.view(-1, p.num_local_heads + p.num_local_kv_heads, d), rope)
            q, k = qk.split([p.num_local_heads, p.num_local_kv_heads], dim=1)
        else:
            q, k = qk.split([p.q_size, p.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, p.num_local_heads, d))
            k = self.k_norm(k.view(-1, p.num_local_kv_heads, d))
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    # [num_tokens, 2·d] = [gate | up] -> act(gate) · up: [num_tokens, d]
    act_and_mul = staticmethod(silu_and_mul)

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm)
        self.mlp = LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, rope: RopeAngles, hidden, residual, kv_cache, md):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def _call_layer(layer: LlamaDecoderLayer, rope, hidden, residual, kv_cache, md):
    """One decoder layer; ``torch.compile``d once for all layers (their weights are inputs)."""
    return layer(rope, hidden, residual, kv_cache, md)


class LlamaForCausalLM(nn.Module):
    """``forward(...) -> hidden_states``; ``compute_logits(hidden_states)``; KV heads/ranks described
    by ``kv_cache_shape``. Hidden states of chosen layers can be captured for drafters."""

    qk_norm = False
    # Added to a checkpoint's RMSNorm weights to get the factor the norms scale by (Gemma: 1 + w).
    norm_weight_offset = 0.0
    # Float32 CPU steps through each layer's plan of kernel calls (models/layer_plans.py) where every
    # layer has one: the modules' bits with ~2 ms less Python a forward. A plan calls no module, so
    # hooks on (or a replaced forward of) a layer or its modules do not run: set False to run them
    # (benchmarks/profile_step.py times every module that way).
    use_layer_plans = True
    layer_plan = (LlamaDecoderLayer, layer_plans.LlamaLayerPlan)  # (the decoder layer's class, its plan's)
    # checkpoint sub-name -> (our parameter sub-name, shard id)
    packed = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._build_common(cfg, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, dtype, self.qk_norm) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def _build_common(self, cfg: ModelArchConfig, dtype: torch.dtype) -> None:
        """What every decoder of this interface has: the vocab-parallel embedding and LM head (tied
        if the config says so) and the KV cache's per-slot shape on this rank."""
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        _, (k0, k1) = head_partition(cfg.num_attention_heads, cfg.num_key_value_heads, get_tp_size(), get_tp_rank())
        self.kv_cache_shape = (k1 - k0, cfg.head_dim)  # per slot, per layer
        self._compiled_layer = None  # compile_decode_layers()
        self._layer_plans: layer_plans.LayerPlans | None = None  # built on first use, rebuilt when a weight is re-packed

    def compile_decode_layers(self) -> None:
        """Run decode steps (one query per sequence) through a ``torch.compile``d decoder layer:
        fused elementwise kernels instead of ~40 dispatched ops per layer, which dominate small
        decode batches on CPU. Other steps (prefill, k + 1 speculative queries) stay eager.
        Compilation happens on first use (the engine's is at start-up: ModelRunner.compile_decode);
        shapes are dynamic, so a few graphs serve every batch size and context length."""
        self._compiled_layer = torch.compile(_call_layer, dynamic=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        input_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], replaces the lookup
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns final-norm hidden states [num_tokens, hidden_size] and, for each layer id L in
        ``capture_layers``, the output of layer L (Hugging Face ``hidden_states[L + 1]``)."""
        hidden = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        rope = self.rotary.angles(positions, self.dtype)
        run_layer, residual, plans = _call_layer, None, None
        if md.decode_only and self._compiled_layer is not None:
            run_layer = self._compiled_layer
            self.layers[0].self_attn.attn.context_rows(md)  # memoized per step: built here, outside the graph
            md.groups  # likewise (built on first use)
            residual = torch.zeros_like(hidden)  # the same sums as None, and one graph for every layer
        elif self.use_layer_plans:
            plans = self._plans(hidden, kv_caches)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if plans:
                hidden, residual = plans[i](rope, hidden, residual, kv_caches[i], md)
            else:
                hidden, residual = run_layer(layer, rope, hidden, residual, kv_caches[i], md)
            if i in capture_layers:
                captured[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, captured

    def _plans(self, hidden: torch.Tensor, kv_caches: list) -> list | None:
        """The layers' plans for this step (``layer_plans``), None where the step or a layer takes the modules."""
        if not layer_plans.step_fits(hidden, kv_caches):
            return None
        if self._layer_plans is None or not self._layer_plans.current():
            layer_class, plan_class = self.layer_plan
            exact = all(type(layer) is layer_class for layer in self.layers)  # a subclass computes otherwise
            self._layer_plans = layer_plans.build(self.layers, plan_class) if exact else layer_plans.LayerPlans([])
        return self._layer_plans or None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> the decoder's input [num_tokens, hidden_size] (drafters that
        borrow the target's embedding call this)."""
        return self.embed_tokens(input_ids)

    @staticmethod
    def embed_multiplier(cfg: ModelArchConfig) -> float:
        """The factor ``embed_input_ids`` applies to the embedding rows (drafter training uses it)."""
        return 1.0

    def compute_logits(self, hidden: torch.Tensor, site: str = "logits.all_gather") -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> [num_rows, vocab_size] float32."""
        return self.logits_processor.compute_logits(self.lm_head, hidden, site)

    def compute_logits_shard(self, hidden: torch.Tensor) -> LogitsShard:
        """hidden: [num_rows, hidden_size] -> this rank's columns of the logits [num_rows, shard_size]
        (padding -inf), for vocab-parallel sampling. No communication."""
        return self.logits_processor.compute_logits_shard(self.lm_head, hidden)

    def get_top_tokens(
        self, hidden: torch.Tensor, site: str = "draft.sample", bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> [num_rows] int64, equal to
        ``compute_logits(hidden).argmax(-1)`` (of the tokens ``bitmask`` allows), gathering 8·tp
        bytes per row instead of 4·vocab."""
        return self.logits_processor.get_top_tokens(self.lm_head, hidden, site, bitmask)

    def _target(self, name: str):
        """Map a checkpoint tensor name to (module, parameter, shard id), or None to skip it."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        index = name.split(".")[1] if name.startswith("layers.") else ""
        if index.isdigit() and int(index) >= self.config.num_hidden_layers:
            if int(index) < self.config.num_hidden_layers + self.config.num_nextn_predict_layers:
                return None  # an MTP module's (spec_decode/mtp.py reads it)
        return checkpoint_target(self, name, self.packed)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Load (checkpoint name, sliceable tensor) pairs; returns the names of our parameters loaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            pname, module, param, shard = target
            module.weight_loader(param, tensor, shard)
            loaded.add(pname)
        return loaded
