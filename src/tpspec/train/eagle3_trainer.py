"""Train an EAGLE-3 head on feature shards (see ``train/data.py``) with the training-time test
(``train/chain_trainer.py``); its classes are the draft vocabulary.

The draft vocabulary (``d2t``): the ``draft_vocab_size`` tokens the target predicts most often in
the training data; ``draft_vocab_coverage`` measures what share of held-out labels a size keeps.
"""

from __future__ import annotations

import torch

from tpspec.train.chain_trainer import ChainTrainer
from tpspec.train.eagle3_module import Eagle3TrainModel
from tpspec.train.recipe import TrainConfig
from tpspec.train.trainer import FeatureData


def label_counts(data: FeatureData, vocab_size: int, continuation_only: bool = False) -> torch.Tensor:
    """How often the target predicts each token id in ``data`` [vocab_size] (``continuation_only``:
    at the positions whose prediction is a continuation token, as drafting meets them)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(data.seqs)):
        _, _, argmax, p = data.get(i)
        counts += torch.bincount(argmax[max(0, p - 1) :] if continuation_only else argmax, minlength=vocab_size)
    return counts


def choose_draft_vocab(train: FeatureData, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` token ids the target predicts most often in ``train``, ascending [size]."""
    counts = label_counts(train, vocab_size)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


def draft_vocab_coverage(train: FeatureData, held_out: FeatureData, vocab_size: int, sizes: list[int]) -> dict[int, float]:
    """Per draft vocabulary size: the share of held-out continuation labels inside it."""
    order = torch.argsort(label_counts(train, vocab_size), descending=True, stable=True)
    held = label_counts(held_out, vocab_size, continuation_only=True)
    return {n: float(held[order[:n]].sum() / held.sum().clamp(min=1)) for n in sizes}


class Eagle3Trainer(ChainTrainer):
    name = "EAGLE-3 head"

    def __init__(self, model: Eagle3TrainModel, embed_weight: torch.Tensor, train: FeatureData, held_out: FeatureData,
                 cfg: TrainConfig, out_dir: str, depth: int):
        super().__init__(model, embed_weight, train, held_out, cfg, out_dir, depth)
        self._index_draft_vocab()

    def _index_draft_vocab(self) -> None:
        """target id -> draft id (−100 outside) [vocab], from the head's own ``d2t``."""
        self.draft_index = torch.full((self.embed.shape[0],), -100, dtype=torch.int64, device=self.device)
        self.draft_index[self.model.target_ids] = torch.arange(self.model.config.draft_vocab_size, device=self.device)

    def maybe_resume(self) -> bool:
        # A checkpoint's head keeps its draft vocabulary even when the data (hence the vocabulary
        # chosen from it) has grown since: the labels follow the head's.
        resumed = super().maybe_resume()
        self._index_draft_vocab()
        return resumed

    def classes(self, labels: torch.Tensor) -> torch.Tensor:
        return self.draft_index[labels.clamp(min=0)].masked_fill(labels < 0, -100)

    def class_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(rows)

    def predict(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.target_ids[self.model.lm_head(rows).argmax(-1)]
