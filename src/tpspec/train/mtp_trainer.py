"""Train an MTP module on feature shards (the target's final-norm output, ``FINAL_HIDDEN``) with the
training-time test (``train/chain_trainer.py``). The LM head is the target's, frozen; the loss's
classes are the full vocabulary or (``loss_vocab: labels``) the tokens the target predicts in the
training data, a far smaller softmax; drafts are scored over the full vocabulary, as served."""

from __future__ import annotations

import torch

from tpspec.train.chain_trainer import ChainTrainer
from tpspec.train.mtp_module import MTPTrainModel
from tpspec.train.recipe import TrainConfig
from tpspec.train.trainer import FeatureData


class MTPTrainer(ChainTrainer):
    name = "MTP module"

    def __init__(
        self,
        model: MTPTrainModel,
        embed_weight: torch.Tensor,  # [vocab_size, H] the target's input embedding
        head_weight: torch.Tensor,  # [vocab_size, H] the target's LM head (frozen)
        train: FeatureData,
        held_out: FeatureData,
        cfg: TrainConfig,
        out_dir: str,
        depth: int,
    ):
        super().__init__(model, embed_weight, train, held_out, cfg, out_dir, depth)
        self.head = head_weight.float().to(self.device)
        vocab = self.head.shape[0]
        class_ids = (train.label_ids() if cfg.loss_vocab == "labels" else torch.arange(vocab)).to(self.device)  # [num_classes]
        self.class_index = torch.full((vocab,), -100, dtype=torch.int64, device=self.device)  # target id -> class id
        self.class_index[class_ids] = torch.arange(len(class_ids), device=self.device)
        self.class_head = self.head[class_ids]  # [num_classes, H]

    def classes(self, labels: torch.Tensor) -> torch.Tensor:
        return self.class_index[labels.clamp(min=0)].masked_fill(labels < 0, -100)

    def class_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return rows @ self.class_head.T

    def predict(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows.float() @ self.head.T).argmax(-1)
