"""Gemma 3 (text) from TP layers, as Hugging Face's ``Gemma3ForCausalLM`` computes it.

What differs from Llama: RMSNorm scales by (1 + weight); the embedding is multiplied by
√hidden_size (rounded to the model's dtype); queries and keys are RMS-normed per head before
RoPE; scores are scaled by query_pre_attn_scalar^−½; the MLP is GeGLU with tanh-approximated
GELU; each layer norms four times (before and after attention, before and after the MLP, the
outputs normed before they join the residual stream); most layers attend over a sliding window
(``layer_types``) with their own RoPE base, the others over the whole context; the final logits
may be soft-capped (``LogitsProcessor``). The single KV head of the small models is replicated
on every rank while the query heads are split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.config import ModelArchConfig
from tpspec.layers.attention import AttentionMetadata
from tpspec.layers.logits import LogitsProcessor
from tpspec.layers.norm import RMSNorm
from tpspec.layers.rotary import RopeAngles, RotaryEmbedding
from tpspec.models import layer_plans
from tpspec.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

SLIDING = "sliding_attention"


class GemmaRMSNorm(RMSNorm):
    """y = x / sqrt(mean(x²) + eps) · (1 + w), in float32, rounded to x's dtype at the end. The
    parameter holds (1 + w) in float32, made so when the checkpoint's w is loaded."""

    weight_offset = 1.0  # what the parameter holds beyond the checkpoint's w

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps, torch.float32)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(loaded[:].float() + self.weight_offset)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2·d] = [gate | up] -> gelu_tanh(gate) · up: [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class Gemma3Attention(LlamaAttention):
    """Qwen3's attention (per-head q/k norms before RoPE) with Gemma's norms, score scale and,
    on the local layers, the sliding window."""

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, sliding: bool):
        super().__init__(cfg, dtype, qk_norm=True, scale=cfg.query_pre_attn_scalar**-0.5,
                         sliding_window=cfg.sliding_window if sliding else None)

    @staticmethod
    def _head_norm(cfg: ModelArchConfig, dtype: torch.dtype) -> nn.Module:
        return GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3MLP(LlamaMLP):
    """GeGLU: Llama's MLP with tanh-approximated GELU."""

    act_and_mul = staticmethod(gelu_tanh_and_mul)

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype):
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 hidden_activation {cfg.hidden_activation!r} is not supported; supported: gelu_pytorch_tanh")
        super().__init__(cfg, dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.self_attn = Gemma3Attention(cfg, dtype, sliding)
        self.mlp = Gemma3MLP(cfg, dtype)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, rope: RopeAngles, hidden, kv_cache, md):
        """hidden: [num_tokens, hidden_size], the residual stream -> the stream after this layer."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(hidden), kv_cache, md))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def _call_layer(layer: Gemma3DecoderLayer, rope, hidden, kv_cache, md):
    """One decoder layer; ``torch.compile``d once for all layers (their weights are inputs)."""
    return layer(rope, hidden, kv_cache, md)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's interface (forward, logits, top tokens, weight loading, captures for drafters) over
    Gemma 3's decoder."""

    norm_weight_offset = GemmaRMSNorm.weight_offset
    layer_plan = (Gemma3DecoderLayer, layer_plans.Gemma3LayerPlan)

    def __init__(self, cfg: ModelArchConfig, dtype: torch.dtype = torch.float32):
        if cfg.layer_types is None or cfg.sliding_window is None:
            raise ValueError("a Gemma 3 config needs layer_types and sliding_window")
        nn.Module.__init__(self)
        self._build_common(cfg, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(cfg, dtype, t == SLIDING) for t in cfg.layer_types])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, soft_cap=cfg.final_logit_softcapping)
        # Hugging Face multiplies by √hidden_size rounded to the model's dtype.
        self.register_buffer("embed_scale", torch.tensor(self.embed_multiplier(cfg)).to(dtype), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        input_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size], replaces embed_input_ids
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As ``LlamaForCausalLM.forward``: final-norm hidden states [num_tokens, hidden_size] and
        the captured layers' outputs."""
        hidden = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        ropes = {False: self.rotary.angles(positions, self.dtype), True: self.local_rotary.angles(positions, self.dtype)}
        run_layer, plans = _call_layer, None
        if md.decode_only and self._compiled_layer is not None:
            run_layer = self._compiled_layer
            self.layers[0].self_attn.attn.context_rows(md)  # memoized per step: built here, outside the graph
            if any(layer.sliding for layer in self.layers):
                md.groups[0].window_bias(self.config.sliding_window)  # likewise
        elif self.use_layer_plans:
            plans = self._plans(hidden, kv_caches)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if plans:
                hidden = plans[i](ropes[layer.sliding], hidden, kv_caches[i], md)
            else:
                hidden = run_layer(layer, ropes[layer.sliding], hidden, kv_caches[i], md)
            if i in capture_layers:
                captured[i] = hidden
        return self.norm(hidden), captured

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> the embedding rows times √hidden_size: [num_tokens, hidden_size]."""
        return self.embed_tokens(input_ids) * self.embed_scale

    @staticmethod
    def embed_multiplier(cfg: ModelArchConfig) -> float:
        return cfg.hidden_size**0.5

    def compile_decode_layers(self) -> None:
        """As Llama's: decode steps through a ``torch.compile``d layer."""
        self._compiled_layer = torch.compile(_call_layer, dynamic=True)
