"""A decoder layer's float32 CPU step as direct calls of tpspec's kernels (``layers.cpu_kernels``).

Through its modules a Llama layer makes ~190 Python calls a step (ten module calls with their
hook machinery, the weight lookups, the kernels' usability checks, splits and views): ~75 us a
layer, 2-3 ms of a 7 ms forward at one row on a 2-core Zen 4, as much as the products themselves
at one row. A plan reads what those calls decide once, at build (the packed weights and the
kernels that take them, the head split, the norms' weights), and then makes the same kernel calls
on the same tensors in the same order: the same bits as the modules' path (tests/models), so
batch invariance and sharding invariance hold unchanged.

Plans cover Llama's layer (and Qwen3's, with per-head q/k norms), Gemma 3's and the EAGLE-3
head's. A plan is built for a layer whose every product has a packed CPU weight (any
``--quantization``; the integer formats' kernels called directly, the others through
``cpu_weights.linear``), no bias, and head and hidden sizes the kernels take; it is used while its
weights are the ones packed at build (``current``) and for float32 steps the kernels take
(``step_fits``). What the modules compute with PyTorch's ops there (per-head norms over 3-D
views, Gemma's GELU), a plan computes with the same ops.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tpspec.distributed import comm
from tpspec.layers import cpu_kernels, int8_dot
from tpspec.layers.activation import silu_and_mul
from tpspec.layers.attention import AttentionMetadata
from tpspec.layers.cpu_weights import (INTEGER_FORMATS, INTEGER_WITH_FLOAT16_COPY, QUANTIZED_MAX_ROWS, linear, packed_entry,
                                      packing_generation)
from tpspec.layers.linear import RowParallelLinear
from tpspec.layers.rotary import RopeAngles


class LinearPlan:
    """One product x·Wᵀ through its packed weight, as the module's ``linear`` computes it."""

    def __init__(self, module, reduce: bool):
        self.weight = module.weight
        self.version = self.weight._version
        self.entry = packed_entry(self.weight)  # (weakref, version, PackedWeight): made by packed_weight() just before
        self.reduce = reduce  # a row-parallel product: its partial sums all-reduced (tp > 1)
        packed, weight = self.entry[2], self.weight
        self.call: Callable[[torch.Tensor], torch.Tensor] = lambda x: linear(x, weight, None, packed)
        if packed.format in INTEGER_FORMATS or packed.format in INTEGER_WITH_FLOAT16_COPY:
            data = packed.data if packed.format in INTEGER_FORMATS else packed.data[0]
            kernels, isa = cpu_kernels.kernels(), int8_dot.ISAS.index(int8_dot.isa())
            if packed.format.startswith("q4_1"):
                fn, extra = kernels.q4_1_int8_linear, (data.qweight, data.scales, data.mins)
            else:
                fn, extra = kernels.q8_0_int8_linear, (data.qweight, data.scales, data.qsums)
            args = (*extra, data.out_features, data.activation_bits, isa)
            if packed.format in INTEGER_FORMATS:
                self.call = lambda x: fn(x, *args)  # x contiguous float32
            else:  # up to QUANTIZED_MAX_ROWS rows the integer kernel, past them the float16 copy (``linear``)
                self.call = lambda x: fn(x, *args) if x.shape[0] <= QUANTIZED_MAX_ROWS else linear(x, weight, None, packed)

    @staticmethod
    def of(module) -> "LinearPlan | None":
        """The plan of ``module`` (a ``PackedCPUWeight`` layer), None where it has a bias or no packed
        weight. A row-parallel product is all-reduced as its module's forward does it."""
        if getattr(module, "bias", None) is not None or module.packed_weight() is None:
            return None
        return LinearPlan(module, isinstance(module, RowParallelLinear) and module.tp_size > 1 and module.reduce_results)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] contiguous float32 -> [rows, out]
        y = self.call(x)
        return comm.all_reduce(y, "layer.all_reduce") if self.reduce else y


class AttentionPlan:
    """``LlamaAttention`` (and Gemma 3's): qkv product, per-head q/k norms where it has them,
    rotary, the new keys and values written, paged attention over the cache in place, output product."""

    def __init__(self, attention, qkv: LinearPlan, o: LinearPlan):
        p, a = attention.qkv_proj, attention.attn
        self.qkv, self.o = qkv, o
        self.heads, self.kv_heads, self.d = p.num_local_heads, p.num_local_kv_heads, p.head_dim
        self.q_size, self.qk_width = p.q_size, p.q_size + p.kv_size
        self.window, self.kv_head_of_head, self.scale = a.sliding_window, a.kv_head_of_head, a.scale
        self.wide = cpu_kernels.wide()  # attention's 16-lane path (the same bits)
        # (shape, weight, eps) of F.rms_norm over each head, as the norm modules compute a 3-D input
        self.head_norms = None if attention.q_norm is None else tuple(
            ((self.d,), n.weight, n.eps) for n in (attention.q_norm, attention.k_norm))

    @staticmethod
    def of(attention) -> "AttentionPlan | None":
        if attention.qkv_proj.head_dim % 16:
            return None
        if attention.q_norm is not None and any(n.weight.dtype != torch.float32 for n in (attention.q_norm, attention.k_norm)):
            return None
        qkv, o = LinearPlan.of(attention.qkv_proj), LinearPlan.of(attention.o_proj)
        return None if qkv is None or o is None else AttentionPlan(attention, qkv, o)

    def linears(self) -> tuple[LinearPlan, ...]:
        return self.qkv, self.o

    def __call__(self, rope: RopeAngles, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 md: AttentionMetadata) -> torch.Tensor:  # x: [T, in] -> [T, hidden]
        kernels = cpu_kernels._MODULE
        qkv = self.qkv(x)  # [T, (heads + 2·kv_heads)·d]
        rows = qkv.shape[0]
        if self.head_norms is None:  # query and key heads side by side: one rotation for both
            qk = kernels.rotary(qkv[:, : self.qk_width].view(rows, self.heads + self.kv_heads, self.d), rope.cos, rope.sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
        else:
            (q_shape, q_w, q_eps), (k_shape, k_w, k_eps) = self.head_norms
            q = F.rms_norm(qkv[:, : self.q_size].view(rows, self.heads, self.d), q_shape, q_w, q_eps)
            k = F.rms_norm(qkv[:, self.q_size : self.qk_width].view(rows, self.kv_heads, self.d), k_shape, k_w, k_eps)
            q, k = kernels.rotary(q, rope.cos, rope.sin), kernels.rotary(k, rope.cos, rope.sin)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k, qkv[:, self.qk_width :].view(rows, self.kv_heads, self.d), k_cache, v_cache, md.slot_mapping)
        out = kernels.paged_attention(q.contiguous(), k_cache, v_cache, md.context_slots, md.token_seq,
                                      md.key_range(self.window), self.kv_head_of_head, self.scale, self.wide)
        return self.o(out)


class MLPPlan:
    """``LlamaMLP`` (and Gemma 3's): gate and up in one product, the activation times up, down."""

    def __init__(self, gate_up: LinearPlan, down: LinearPlan, act_and_mul):
        self.gate_up, self.down = gate_up, down
        self.act_and_mul = act_and_mul  # None: SwiGLU's kernel; else the module's own function (Gemma's GELU)

    @staticmethod
    def of(mlp) -> "MLPPlan | None":
        swiglu = type(mlp).act_and_mul is silu_and_mul
        if swiglu and mlp.down_proj.in_features % 8:
            return None
        gate_up, down = LinearPlan.of(mlp.gate_up_proj), LinearPlan.of(mlp.down_proj)
        return None if gate_up is None or down is None else MLPPlan(gate_up, down, None if swiglu else type(mlp).act_and_mul)

    def linears(self) -> tuple[LinearPlan, ...]:
        return self.gate_up, self.down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        act = cpu_kernels._MODULE.silu_and_mul if self.act_and_mul is None else self.act_and_mul
        return self.down(act(self.gate_up(x)))


def _norm(module) -> tuple[torch.Tensor, float]:
    """An RMSNorm module's (weight, eps), as ``add_rms_norm`` takes them."""
    return module.weight, module.eps


class _DecoderLayerPlan:
    """What every decoder layer's plan has: its attention and MLP plans, and norms read at build
    (``_read``). ``of`` builds one where the layer's hidden size and both halves allow it."""

    def __init__(self, layer, attention: AttentionPlan, mlp: MLPPlan):
        self.attention, self.mlp = attention, mlp
        self._read(layer)

    def _read(self, layer) -> None:
        raise NotImplementedError

    @classmethod
    def of(cls, layer):
        """The plan of ``layer``, or None where it has none."""
        if layer.input_layernorm.weight.shape[0] % 8:  # the norm kernel's width
            return None
        attention, mlp = AttentionPlan.of(layer.self_attn), MLPPlan.of(layer.mlp)
        return None if attention is None or mlp is None else cls(layer, attention, mlp)

    def linears(self) -> tuple[LinearPlan, ...]:
        return (*self.attention.linears(), *self.mlp.linears())


class LlamaLayerPlan(_DecoderLayerPlan):
    """``LlamaDecoderLayer.forward``: (residual add and) RMSNorm, attention, RMSNorm, MLP."""

    def _read(self, layer) -> None:
        self.input_norm, self.post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)

    def __call__(self, rope: RopeAngles, hidden: torch.Tensor, residual: torch.Tensor | None,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        add_rms_norm = cpu_kernels._MODULE.add_rms_norm
        x, residual = add_rms_norm(hidden, residual, *self.input_norm)  # residual None: (norm(hidden), hidden)
        x, residual = add_rms_norm(self.attention(rope, x, kv_cache, md), residual, *self.post_norm)
        return self.mlp(x), residual


class Gemma3LayerPlan(_DecoderLayerPlan):
    """``Gemma3DecoderLayer.forward``: RMSNorm, attention, RMSNorm, added to the stream; RMSNorm,
    MLP, RMSNorm, added to the stream."""

    def _read(self, layer) -> None:
        self.norms = tuple(_norm(n) for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                               layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm))

    def __call__(self, rope: RopeAngles, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 md: AttentionMetadata) -> torch.Tensor:
        add_rms_norm = cpu_kernels._MODULE.add_rms_norm
        pre_attention, post_attention, pre_mlp, post_mlp = self.norms
        x = self.attention(rope, add_rms_norm(hidden, None, *pre_attention)[0], kv_cache, md)
        hidden = hidden + add_rms_norm(x, None, *post_attention)[0]
        x = self.mlp(add_rms_norm(hidden, None, *pre_mlp)[0])
        return hidden + add_rms_norm(x, None, *post_mlp)[0]


class Eagle3MidlayerPlan(_DecoderLayerPlan):
    """The EAGLE-3 midlayer (``models/eagle3.Eagle3DecoderLayer``): the token embeddings and the
    carried hidden states each RMS-normed, side by side into attention, then RMSNorm and MLP."""

    def _read(self, layer) -> None:
        self.input_norm, self.hidden_norm = _norm(layer.input_layernorm), _norm(layer.hidden_norm)
        self.post_norm = _norm(layer.post_attention_layernorm)
        self.norm_before_residual = layer.norm_before_residual

    def __call__(self, rope: RopeAngles, embeds: torch.Tensor, hidden: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        add_rms_norm = cpu_kernels._MODULE.add_rms_norm
        normed_hidden, _ = add_rms_norm(hidden, None, *self.hidden_norm)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([add_rms_norm(embeds, None, *self.input_norm)[0], normed_hidden], dim=-1)  # [T, 2H]
        x, residual = add_rms_norm(self.attention(rope, x, kv_cache, md), residual, *self.post_norm)
        return self.mlp(x), residual


def step_fits(hidden: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether a step can run through plans: float32 on CPU outside autograd and compiling with the
    kernels loaded (``cpu_kernels.usable``), and a float32 or float16 KV cache (what the attention
    kernel reads)."""
    return (cpu_kernels.usable(hidden) is not None and hidden.is_contiguous()
            and kv_caches[0][0].dtype in (torch.float32, torch.float16))


class LayerPlans(list):
    """A model's plans (one per layer, or a head's one), and whether their weights are still those
    packed when they were built (``current``: checked every forward, ~20 us for 120 products)."""

    def __init__(self, plans: list):
        super().__init__(plans)
        self._linears = tuple(lin for p in plans for lin in p.linears())
        # each weight, its version and its storage's address at build
        self._weights = tuple((lin.weight, lin.version, lin.weight.data_ptr()) for lin in self._linears)
        self._generation = packing_generation()  # the registry's, when its entries were last confirmed

    def current(self) -> bool:
        for weight, version, ptr in self._weights:  # changed in place, or given new storage (.data =)
            if weight._version != version or weight.data_ptr() != ptr:
                return False
        if self._generation == packing_generation():  # no entry made or dropped since: none re-packed
            return True
        if all(packed_entry(lin.weight) is lin.entry for lin in self._linears):
            self._generation = packing_generation()
            return True
        return False


def build(layers, plan_class) -> LayerPlans:
    """One ``plan_class`` plan per layer of ``layers``, or none where any layer has none (the
    modules then run every step)."""
    plans = [plan_class.of(layer) for layer in layers]
    return LayerPlans([] if any(p is None for p in plans) else plans)
