"""A trainable, dense MTP module whose ``save_pretrained`` writes the DeepSeek-V3 layout vLLM reads
(``model.layers.{N}.{enorm, hnorm, eh_proj, <decoder block>, shared_head.norm}`` beside the
target's ``config.json`` with ``num_nextn_predict_layers: 1``), run over whole sequences with the
training-time test (``train/chain_trainer.py``): the chain the drafter builds, unrolled ``depth``
steps for every position at once, attending as the serving module's paged cache does. Same math
as ``tpspec.models.mtp``: step 0 row t takes the target's final-norm output at t and the embedding
of token t + 1 (zeroed at position 0); step j takes the previous step's pre-norm output.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from tpspec.config import ModelArchConfig
from tpspec.layers.rotary import RotaryEmbedding
from tpspec.models.mtp import MTPConfig
from tpspec.train.dense_layers import ChainAttention, GatedMLP, RMSNorm


class MTPTrainModel(nn.Module):
    def __init__(self, cfg: MTPConfig, target_config: dict):
        """``target_config``: the target's ``config.json``, which the exported module carries."""
        super().__init__()
        a = cfg.arch
        if cfg.num_nextn_predict_layers != 1:
            raise ValueError(f"train-draft trains one MTP layer, got num_nextn_predict_layers={cfg.num_nextn_predict_layers}")
        self.config, self.target_config = cfg, target_config
        h = a.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, a.rms_norm_eps), RMSNorm(h, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.self_attn = ChainAttention(a, h, cfg.qk_norm)
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.mlp = GatedMLP(a)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] the target's final-norm output
        embeds: torch.Tensor,  # [B, T + depth, H] the target's embeddings of tokens 0 … T + depth − 1
        depth: int,
    ) -> list[torch.Tensor]:
        """The chain steps' ``shared_head.norm`` outputs, [B, T, H] each: step j, row t predicts token t + j + 2."""
        b, t, _ = features.shape
        hidden = features
        base, chain, outs = None, [], []
        for j in range(depth):
            positions = (torch.arange(t, device=features.device) + j).clamp(max=self.rotary.cos.shape[0] - 1).expand(b, t)
            e = embeds[:, j + 1 : j + 1 + t]
            if j == 0:  # as the serving module: position 0 takes no token
                e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))  # [B, T, H]
            attn, kv = self.self_attn(self.input_layernorm(x), positions, self.rotary, base, chain)
            if base is None:
                base = kv
            else:
                chain.append(kv)
            residual = attn + x
            prenorm = self.mlp(self.post_attention_layernorm(residual)) + residual
            outs.append(self.shared_head.norm(prenorm))
            hidden = prenorm
        return outs

    def save_pretrained(self, folder: str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` (the target's, with ``num_nextn_predict_layers: 1``) and
        ``model.safetensors`` holding ``model.layers.{num_hidden_layers}.*``."""
        os.makedirs(folder, exist_ok=True)
        prefix = f"model.layers.{self.config.first_layer}."
        tensors = {prefix + k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()
                   if not k.startswith("rotary.")}
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        config = dict(self.target_config, num_nextn_predict_layers=1, torch_dtype=str(dtype).removeprefix("torch."))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def new_mtp_config(target_config: dict) -> MTPConfig:
    """One MTP layer shaped like the target's decoder layers."""
    cfg = MTPConfig.from_hf_config(dict(target_config, num_nextn_predict_layers=1))
    cfg.validate(ModelArchConfig.from_hf_config(target_config))
    return cfg
