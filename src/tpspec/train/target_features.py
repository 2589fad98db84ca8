"""The target's hidden states and next-token predictions over whole sequences, computed with the
serving model itself (TP 1, a scratch paged KV cache), so that a drafter trains on exactly the
features the engine captures."""

from __future__ import annotations

import torch

from tpspec.config import ModelArchConfig
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache, kv_cache_dtype
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.registry import get_model_class
from tpspec.spec_decode.speculator import target_features

BLOCK = 16


class TargetFeatureExtractor:
    def __init__(self, model_folder: str, target_layer_ids: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.arch = ModelArchConfig.from_folder(model_folder)
        self.device = device
        with device:
            self.model = get_model_class(self.arch.architecture)(self.arch, dtype)
        self.model.load_weights(iterate_weights(model_folder))
        self.model.eval()
        self.layers = tuple(target_layer_ids)
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns features [N, n·H] (outputs of ``target_layer_ids``, concatenated; ``FINAL_HIDDEN``:
        the final-norm output) and the argmax prediction of the next token [N], N = all tokens, on
        the extractor's device."""
        lens = [len(s) for s in seqs]
        tables, next_block = [], 0
        for n in lens:
            blocks = (n + BLOCK - 1) // BLOCK
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        dtype = kv_cache_dtype("auto", self.dtype, self.device)  # as an engine caches them by default
        kv = allocate_kv_cache(self.arch.num_hidden_layers, next_block * BLOCK, self.model.kv_cache_shape, dtype, self.device)
        md = AttentionMetadata.build(lens, lens, tables, BLOCK, self.device)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        hidden, captured = self.model(ids, pos, kv, md, self.layers)
        features = target_features(self.layers, captured, hidden)
        preds = torch.cat([self.model.compute_logits(h).argmax(-1) for h in hidden.split(1024)])
        return features, preds
