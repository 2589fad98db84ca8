"""``method: eagle3`` (alias ``eagle``): an EAGLE-3 head drafting a chain of k tokens from the
target's hidden states at three layers, fused by its ``fc`` (the loop: ``spec_decode/chain_head.py``).
"""

from __future__ import annotations

import torch

from tpspec.config import ModelArchConfig, SpeculativeConfig
from tpspec.distributed.parallel_state import get_tp_rank
from tpspec.models.eagle3 import Eagle3Config, Eagle3LlamaForCausalLM
from tpspec.models.loader.safetensors import iterate_weights, weight_names
from tpspec.spec_decode.chain_head import ChainHeadProposer
from tpspec.spec_decode.speculator import DRAFT_SAMPLE_SITE, DrafterInfo, check_local_argmax_reduction


def ships_embedding(folder: str) -> bool:
    """Whether the EAGLE-3 checkpoint in ``folder`` has its own ``embed_tokens.weight``."""
    return "embed_tokens.weight" in weight_names(folder)


class Eagle3Proposer(ChainHeadProposer):
    @classmethod
    def inspect_drafter(cls, spec: SpeculativeConfig, target: ModelArchConfig) -> DrafterInfo:
        eagle = Eagle3Config.from_folder(spec.model)
        eagle.validate(target, ships_embedding(spec.model))
        check_local_argmax_reduction(spec, Eagle3LlamaForCausalLM)
        return DrafterInfo(eagle.arch)

    def __init__(self, spec_config, engine_config, device):
        super().__init__(spec_config, engine_config, device)
        self.eagle_config = Eagle3Config.from_folder(spec_config.model)
        self.ships_embedding = ships_embedding(spec_config.model)
        self.eagle_config.validate(engine_config.arch, self.ships_embedding)
        # fc's inputs in fc order (a layer may repeat); the runner concatenates them in this order.
        self.capture_layers = self.eagle_config.fc_layers(engine_config.arch.num_hidden_layers)
        self.feature_width = len(self.capture_layers) * self.eagle_config.target_hidden_size
        self.hidden_size = self.eagle_config.arch.hidden_size

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        """The midlayer follows draft_tensor_parallel_size (1: replicated, else split like the
        target); the embedding and the draft LM head are vocab-parallel either way."""
        folder = self.spec_config.model
        target_embed = None if self.ships_embedding else target_model.embed_tokens
        with torch.device(self.device):
            model = Eagle3LlamaForCausalLM(self.eagle_config, target_model.config, target_embed, target_model.dtype, self.replicated_draft)
        model.load_weights(iterate_weights(folder, show_progress=get_tp_rank() == 0))
        model.eval()
        (self.kv_cache,) = self._allocate_kv(model, 1)  # one midlayer
        return model

    def _greedy_sample_draft(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """As the base class's; without the flag, the argmax over the gathered draft vocabulary."""
        if self.use_local_argmax_reduction:
            return super()._greedy_sample_draft(hidden, bitmask)
        return self.model.greedy_tokens(hidden, site=DRAFT_SAMPLE_SITE, bitmask=bitmask)

    def _hidden(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.combine_hidden_states(features)

    def _forward(self, ids, positions, hidden, md, step):
        return self.model(ids, positions, hidden, self.kv_cache, md)
