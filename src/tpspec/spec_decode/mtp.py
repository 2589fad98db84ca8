"""``method: mtp``: multi-token prediction modules (DeepSeek-V3 layout, ``models/mtp.py``) drafting a
chain of k tokens from the target's final-norm output (the loop: ``spec_decode/chain_head.py``).
Chain step j runs MTP layer j mod num_nextn_predict_layers, each with its own paged KV cache;
the draft tokens come from the vocab-parallel LM head, so ``use_local_argmax_reduction`` applies.
"""

from __future__ import annotations

import torch

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.distributed.parallel_state import get_tp_rank
from tpspec.models.loader.safetensors import iterate_weights, weight_names
from tpspec.models.mtp import MTPConfig, MTPModel, ships_lm_head
from tpspec.spec_decode.chain_head import ChainHeadProposer
from tpspec.spec_decode.speculator import FINAL_HIDDEN, DrafterInfo, check_local_argmax_reduction


class MTPProposer(ChainHeadProposer):
    capture_layers = (FINAL_HIDDEN,)

    @classmethod
    def inspect_drafter(cls, spec: SpeculativeConfig, target: ModelArchConfig) -> DrafterInfo:
        mtp = MTPConfig.from_folder(spec.model)
        mtp.validate(target)
        check_local_argmax_reduction(spec, MTPModel)
        return DrafterInfo(mtp.arch)

    def __init__(self, spec_config, engine_config, device):
        super().__init__(spec_config, engine_config, device)
        self.mtp_config = MTPConfig.from_folder(spec_config.model)
        self.mtp_config.validate(engine_config.arch)
        self.feature_width = self.hidden_size = engine_config.arch.hidden_size

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        """The MTP blocks follow draft_tensor_parallel_size (1: replicated, else split like the
        target); the embedding and the LM head (the target's unless shipped) are vocab-parallel."""
        folder = self.spec_config.model
        head = None if ships_lm_head(weight_names(folder), self.mtp_config) else target_model.lm_head
        with torch.device(self.device):
            model = MTPModel(self.mtp_config, target_model.config, target_model.embed_tokens, head, target_model.dtype,
                             self.replicated_draft)
        model.load_weights(iterate_weights(folder, show_progress=get_tp_rank() == 0))
        model.eval()
        self.kv_caches = self._allocate_kv(model, self.mtp_config.num_nextn_predict_layers)
        return model

    def _hidden(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the target's final-norm output is the first step's hidden state

    def _forward(self, ids, positions, hidden, md, step):
        layer = step % self.mtp_config.num_nextn_predict_layers
        return self.model(ids, positions, hidden, self.kv_caches[layer], md, layer)
