"""What training a chain head shares (EAGLE-3, MTP): the training-time test's batches, loss and
held-out acceptance.

Every position t of a sequence is a chain origin: step j's output at row t predicts token
t + j + 2, labelled with the target's argmax there (``argmax[t + j + 1]``), which is the token
greedy decoding emits while the sequence follows the target's greedy chain from t + 1 on (tokens
t + 2 … t + j + 1 equal the target's predictions); past that point there is no label. The tokens a
chain is fed are the sequence's own, which on the greedy chain are the drafts an accepted chain
fed. Loss: cross-entropy over the head's classes (a method's vocabulary), weighted by exp(−j/γ); a
label outside them has none (the head can never draft it).

Held-out acceptance: every origin of a held-out continuation, scored as greedy verification scores
a k = depth chain (1 + the number of leading drafts equal to the target's predictions), and
reported along the origins greedy speculation visits (``train/held_out_acceptance.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpspec.train.held_out_acceptance import HeldOutAcceptance
from tpspec.train.recipe import TrainConfig
from tpspec.train.trainer import DraftTrainer, FeatureData


def build_chain_batch(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], depth: int):
    """Batch tensors for whole sequences (tokens [n], features [n, F], argmax [n]).

    Returns features [B, T, F] (the sequences' dtype), input_ids [B, T + depth] (zero-padded) and
    labels [depth, B, T]: the target id step j's row t must draft, −100 where there is none."""
    b, t_max = len(seqs), max(len(tok) for tok, _, _ in seqs)
    features = torch.zeros(b, t_max, seqs[0][1].shape[-1], dtype=seqs[0][1].dtype)
    input_ids = torch.zeros(b, t_max + depth, dtype=torch.int64)
    labels = torch.full((depth, b, t_max), -100, dtype=torch.int64)
    for i, (tok, feat, argmax) in enumerate(seqs):
        n = len(tok)
        features[i, :n] = feat
        input_ids[i, :n] = tok
        agree = torch.zeros(n + depth, dtype=torch.bool)
        agree[: n - 1] = tok[1:] == argmax[:-1]  # token s + 1 is the target's prediction at s
        on_chain = torch.ones(n, dtype=torch.bool)
        for j in range(depth):
            if j:
                on_chain &= agree[j : j + n]  # chain t fed token t + j + 1: the prediction at t + j
            src = torch.arange(n) + j + 1
            ok = on_chain & (src < n)
            labels[j, i, :n][ok] = argmax[src[ok]]
    return features, input_ids, labels


class ChainTrainer(DraftTrainer):
    """A method defines its classes: ``classes`` (label target ids -> class ids, −100 outside),
    ``class_logits`` (rows -> logits over the classes) and ``predict`` (rows -> drafted target ids)."""

    def __init__(
        self,
        model: torch.nn.Module,  # forward(features [B, T, F], embeds [B, T + depth, H], depth) -> [B, T, H] per step
        embed_weight: torch.Tensor,  # [vocab_size, H] the target's input embedding, as the serving head reads it
        train: FeatureData,
        held_out: FeatureData,
        cfg: TrainConfig,
        out_dir: str,
        depth: int,  # chain steps trained per origin (EAGLE-3's training-time test)
    ):
        super().__init__(model, train, held_out, cfg, out_dir)
        self.embed = embed_weight.float().to(self.device)
        self.depth = depth
        self.step_weight = torch.exp(-torch.arange(depth) / cfg.loss_decay_gamma).to(self.device)  # [depth]

    def classes(self, labels: torch.Tensor) -> torch.Tensor:
        """labels: target ids, −100 for none [n] -> class ids, −100 for none or outside [n]."""
        raise NotImplementedError

    def class_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, H] final-norm outputs -> [n, num_classes]."""
        raise NotImplementedError

    def predict(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, H] -> [n] the target ids the serving head drafts."""
        raise NotImplementedError

    def _forward(self, seqs):
        features, input_ids, labels = (t.to(self.device) for t in build_chain_batch(seqs, self.depth))
        return self.model(features.float(), F.embedding(input_ids, self.embed), self.depth), labels

    def batch_loss(self) -> tuple[torch.Tensor, int]:
        seqs = []
        for _ in range(self.cfg.seqs_per_step):
            tok, feat, argmax, _ = self.train_data.get(self.rng.randrange(len(self.train_data.seqs)))
            seqs.append((tok, feat, argmax))
        outs, labels = self._forward(seqs)
        total, weight, rows = 0.0, 0.0, 0
        for j, normed in enumerate(outs):
            target = self.classes(labels[j].reshape(-1))  # [B·T]
            valid = target >= 0
            if not valid.any():
                continue
            logits = self.class_logits(normed.reshape(-1, normed.shape[-1])[valid])  # [rows, classes]
            total = total + self.step_weight[j] * F.cross_entropy(logits, target[valid], reduction="sum")
            weight += float(self.step_weight[j]) * int(valid.sum())
            rows += int(valid.sum())
        return total / max(weight, 1.0), rows

    @torch.no_grad()
    def evaluate(self, max_seqs: int | None = None) -> dict:
        """Held-out acceptance (k = depth; ``train/held_out_acceptance.py``)."""
        self.model.eval()
        n_seqs = len(self.held_out.seqs) if max_seqs is None else min(max_seqs, len(self.held_out.seqs))
        scores = HeldOutAcceptance(self.depth)
        for i in range(n_seqs):
            tok, feat, argmax, p = self.held_out.get(i)
            origins = torch.arange(max(0, p - 1), len(tok) - self.depth - 1)  # every label of a k-chain present
            if not len(origins):
                continue
            outs, labels = self._forward([(tok, feat, argmax)])
            scores.add(torch.stack([self.predict(normed[0, origins]) == labels[j, 0, origins] for j, normed in enumerate(outs)],
                                   dim=1).cpu())  # [origins, depth]
        return scores.result()
