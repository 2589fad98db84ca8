"""A trainable, dense EAGLE-3 head whose ``state_dict`` is the public checkpoint layout
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``), run over whole sequences with EAGLE-3's
training-time test: the chain a drafter builds, unrolled ``depth`` steps for every position at once.

Step 0, row t (t = 0 … T − 1): fc(target features at t) with the embedding of token t + 1, at
position t, causal over the step-0 rows; its output predicts token t + 2. Step j ≥ 1, row t (the
chain that starts at t): the previous step's pre-norm output of row t with the embedding of token
t + j + 1, at position t + j; it attends to the step-0 rows at positions ≤ t and to its own chain's
rows of steps 1 … j, which is exactly what the serving head's paged cache holds when it drafts
from origin t (see ``spec_decode/chain_head.py``). Same math as ``tpspec.models.eagle3``.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from tpspec.config import ModelArchConfig
from tpspec.layers.rotary import RotaryEmbedding
from tpspec.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Config
from tpspec.train.dense_layers import ChainAttention, GatedMLP, RMSNorm, plain_draft_arch


def new_eagle3_config(target: ModelArchConfig, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
    """A head shaped like one of the target's layers (Llama style: SiLU, no q/k norms, one RoPE
    base), reading the target's hidden states at ``aux_layer_ids`` (Hugging Face ``hidden_states``
    indices; None: EAGLE-3's default (2, N // 2, N − 3))."""
    arch = plain_draft_arch(target, EAGLE3_ARCHITECTURES[0], 1)
    cfg = Eagle3Config(arch, draft_vocab_size, target.hidden_size, aux_layer_ids, norm_before_residual=False)
    cfg.validate(target, ships_embedding=False)
    return cfg


class _Midlayer(nn.Module):
    def __init__(self, a: ModelArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = ChainAttention(a, 2 * a.hidden_size)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = GatedMLP(a)


class Eagle3TrainModel(nn.Module):
    def __init__(self, cfg: Eagle3Config, num_target_layers: int, target_ids: torch.Tensor):
        """``target_ids``: [draft_vocab_size] ascending target token ids of the draft vocabulary."""
        super().__init__()
        a = cfg.arch
        self.config = cfg
        self.num_target_layers = num_target_layers
        self.fc = nn.Linear(len(cfg.fc_layers(num_target_layers)) * cfg.target_hidden_size, a.hidden_size, bias=False)
        self.midlayer = _Midlayer(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", target_ids - torch.arange(cfg.draft_vocab_size))  # draft id i -> i + d2t[i]
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(
        self,
        features: torch.Tensor,  # [B, T, n·H_t] target hidden states at fc_layers, in fc order
        embeds: torch.Tensor,  # [B, T + depth, H] the target's embeddings of tokens 0 … T + depth − 1
        depth: int,
    ) -> list[torch.Tensor]:
        """The chain steps' final-norm outputs, [B, T, H] each: step j, row t predicts token t + j + 2."""
        b, t, _ = features.shape
        layer = self.midlayer
        hidden = self.fc(features)
        base, chain, outs = None, [], []
        for j in range(depth):
            positions = (torch.arange(t, device=features.device) + j).clamp(max=self.rotary.cos.shape[0] - 1).expand(b, t)
            normed_hidden = layer.hidden_norm(hidden)
            x = torch.cat([layer.input_layernorm(embeds[:, j + 1 : j + 1 + t]), normed_hidden], dim=-1)  # [B, T, 2H]
            attn, kv = layer.self_attn(x, positions, self.rotary, base, chain)
            if base is None:
                base = kv
            else:
                chain.append(kv)
            residual = attn + hidden
            prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
            outs.append(self.norm(prenorm))
            hidden = prenorm
        return outs

    def save_pretrained(self, folder: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the public EAGLE-3 layout."""
        cfg, a = self.config, self.config.arch
        os.makedirs(folder, exist_ok=True)
        tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v).cpu().contiguous() for k, v in self.state_dict().items()}
        t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
        t2d[self.target_ids.cpu()] = True
        tensors["t2d"] = t2d  # [vocab_size] target id -> in the draft vocabulary (EAGLE's reader wants it)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": [a.architecture],
            "model_type": "llama",
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": a.rope_scaling,
            "max_position_embeddings": a.max_position_embeddings,
            "vocab_size": a.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": [j + 1 for j in cfg.fc_layers(self.num_target_layers)],
            "norm_before_residual": cfg.norm_before_residual,
            "attention_bias": a.attention_bias,
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
