"""A trainable, dense DFlash draft model whose ``state_dict`` is the public checkpoint layout.

Same math as the serving model (``tpspec.models.dflash``), written for batches of whole
sequences with many draft blocks each: every block attends to the context features before its
anchor and, non-causally, to itself; an explicit boolean mask says which keys a query sees.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tpspec.models.dflash import DFlashConfig
from tpspec.layers.rotary import RotaryEmbedding
from tpspec.train.dense_layers import GatedMLP, RMSNorm


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        a = cfg.arch
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, ctx, ctx_pos, block_pos, mask, rotary: RotaryEmbedding) -> torch.Tensor:
        """x: [B, Q, H] block; ctx: [B, T, H] context features; mask: [B, Q, T + Q] bool (True = attend)."""
        b, q_len, _ = x.shape
        d = self.head_dim
        q = rotary.rotate(block_pos.reshape(-1), self.q_norm(self.q_proj(x).view(-1, self.heads, d)))
        kv_in = torch.cat([ctx, x], dim=1)  # [B, T + Q, H]
        pos = torch.cat([ctx_pos, block_pos], dim=1).reshape(-1)
        k = rotary.rotate(pos, self.k_norm(self.k_proj(kv_in).view(-1, self.kv_heads, d)))
        v = self.v_proj(kv_in)
        q = q.view(b, q_len, self.heads, d).transpose(1, 2)  # [B, heads, Q, d]
        k = k.view(b, -1, self.kv_heads, d).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        v = v.view(b, -1, self.kv_heads, d).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, heads, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * d))


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        a = cfg.arch
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = GatedMLP(cfg.arch)

    def forward(self, x, ctx, ctx_pos, block_pos, mask, rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, ctx_pos, block_pos, mask, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashTrainModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        a = cfg.arch
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(a.num_hidden_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, n·H] target hidden states at target_layer_ids
        ctx_pos: torch.Tensor,  # [B, T]
        block_embeds: torch.Tensor,  # [B, Q, H] target embeddings of the block tokens
        block_pos: torch.Tensor,  # [B, Q]
        mask: torch.Tensor,  # [B, Q, T + Q] bool: which context and block keys each block query sees
    ) -> torch.Tensor:  # [B, Q, H] final-norm hidden states of the block tokens
        ctx = self.hidden_norm(self.fc(features))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, block_pos, mask, self.rotary)
        return self.norm(x)

    def save_pretrained(self, folder: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the public DFlash layout."""
        cfg, a = self.config, self.config.arch
        os.makedirs(folder, exist_ok=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_hidden_layers": a.num_hidden_layers,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads,
            "head_dim": a.head_dim,
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_position_embeddings,
            "vocab_size": a.vocab_size,
            "attention_bias": a.attention_bias,
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers,
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        }
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
