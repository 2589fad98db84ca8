"""Train a DFlash drafter on feature shards (see ``train/data.py``), with checkpoints and resume.

A training example is a draft block anchored at position a of a sequence: inputs are the target
features of positions < a and the block ``[token a, MASK × (block_size − 1)]``; the label of block
output j is the target's argmax prediction of token a + j (its prediction at position a + j − 1).
Many blocks share one sequence's context in a single forward (a mask keeps them apart). Loss:
cross-entropy through the target's frozen LM head, weighted by exp(−(j − 1)/γ) so that early
positions, which gate acceptance, count most.

Held-out acceptance: on sequences the model never trains on, every anchor's block is scored the
way greedy verification scores it: acceptance length = 1 + the number of leading drafts equal to
the target's predictions (bonus token included), averaged over anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpspec.config import ModelArchConfig
from tpspec.layers.logits import soft_cap
from tpspec.models.dflash import DFLASH_ARCHITECTURE, DFlashConfig
from tpspec.models.registry import get_model_class
from tpspec.train.dense_layers import plain_draft_arch
from tpspec.train.dflash_module import DFlashTrainModel
from tpspec.train.held_out_acceptance import HeldOutAcceptance
from tpspec.train.recipe import TrainConfig
from tpspec.train.trainer import DraftTrainer, FeatureData


def new_dflash_config(
    target: ModelArchConfig, num_layers: int, target_layer_ids: tuple[int, ...], block_size: int, mask_token_id: int
) -> DFlashConfig:
    """A drafter shaped like the target's layers, ``num_layers`` deep, in the public layout's
    Qwen3 style (q/k norms, SiLU, full attention, one RoPE base) whatever the target's style."""
    arch = plain_draft_arch(target, DFLASH_ARCHITECTURE, num_layers)
    cfg = DFlashConfig(arch, block_size, mask_token_id, tuple(target_layer_ids), target.num_hidden_layers)
    cfg.validate(target, block_size - 1)
    return cfg


def qwen3_layer_view(target_state: dict[str, torch.Tensor], target: ModelArchConfig, layer: int) -> dict[str, torch.Tensor]:
    """Target decoder layer ``layer``'s tensors under a Qwen3 layer's names (the draft layers').

    Llama and Qwen3 layers map one to one (Llama has no q/k norms). Norm weights get the target's
    ``norm_weight_offset`` (a Gemma 3 checkpoint stores w of y = x̂·(1 + w)). A layer with
    Gemma's four norms norms before the MLP with ``pre_feedforward_layernorm``; its norms after
    attention and after the MLP have no place in a Qwen3 layer and are dropped, and its GELU MLP
    weights run under SiLU: a starting point, not the same function."""
    prefix = f"model.layers.{layer}."
    offset = get_model_class(target.architecture).norm_weight_offset
    tensors = {k[len(prefix):]: v.float() for k, v in target_state.items() if k.startswith(prefix)}
    renamed = {}
    if "pre_feedforward_layernorm.weight" in tensors:
        renamed = {"pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                   "post_attention_layernorm.weight": None, "post_feedforward_layernorm.weight": None}
    out = {}
    for name, t in tensors.items():
        new = renamed.get(name, name)
        if new is not None:
            out[new] = t + offset if new.endswith("norm.weight") else t
    return out


def init_from_target(
    model: DFlashTrainModel, target_state: dict[str, torch.Tensor], target: ModelArchConfig, target_layers: list[int]
) -> None:
    """Copy target decoder layers ``target_layers`` into the draft layers (``qwen3_layer_view``;
    a q/k norm the target lacks stays 1)."""
    for i, t in enumerate(target_layers):
        view = qwen3_layer_view(target_state, target, t)
        for name, param in model.layers[i].named_parameters():
            if name in view:
                param.data.copy_(view[name])


def build_blocks(
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]],
    block_size: int,
    mask_token_id: int,
):
    """Batch tensors for sequences with chosen anchors: (tokens, features, argmax, anchors).

    Returns features [B, T, n·H], ctx_pos [B, T], block_ids [B, Q], block_pos [B, Q],
    mask [B, Q, T + Q] bool, labels [B, Q] (−100 = none: block position 0, past the end, off the
    greedy chain, padding).
    """
    b = len(seqs)
    t_max = max(len(tok) for tok, _, _, _ in seqs)
    q_max = max(len(a) for _, _, _, a in seqs) * block_size
    width = seqs[0][1].shape[-1]
    features = torch.zeros(b, t_max, width, dtype=torch.float32)
    ctx_pos = torch.arange(t_max).expand(b, t_max).contiguous()
    block_ids = torch.full((b, q_max), mask_token_id, dtype=torch.int64)
    block_pos = torch.zeros(b, q_max, dtype=torch.int64)
    mask = torch.zeros(b, q_max, t_max + q_max, dtype=torch.bool)
    labels = torch.full((b, q_max), -100, dtype=torch.int64)
    j = torch.arange(block_size)
    for i, (tok, feat, argmax, anchors) in enumerate(seqs):
        n = len(tok)
        features[i, :n] = feat.float()
        agree = torch.cat([tok[1:] == argmax[:-1], torch.zeros(block_size, dtype=torch.bool)]).long()  # [n − 1 + bs]
        for r, a in enumerate(anchors):
            q0 = r * block_size
            block_ids[i, q0] = tok[a]
            block_pos[i, q0 : q0 + block_size] = a + j
            mask[i, q0 : q0 + block_size, :a] = True  # context before the anchor
            mask[i, q0 : q0 + block_size, t_max + q0 : t_max + q0 + block_size] = True  # its own block
            src = a + j[1:] - 1  # label of block position j: the target's prediction at a + j − 1
            # ... valid while the sequence follows the target's greedy chain from the anchor
            # (token a + i == its prediction at a + i − 1 for i < j): then it is exactly the token
            # greedy decoding would emit there. Real text stops agreeing sooner than generated text.
            ok = (src < n) & torch.cat([torch.ones(1, dtype=torch.bool), agree[a : a + block_size - 2].cumprod(0).bool()])[: len(src)]
            labels[i, q0 + 1 : q0 + block_size][ok] = argmax[src[ok]]
        # padding queries (no anchor) attend to their own slot so softmax stays finite
        for q in range(len(anchors) * block_size, q_max):
            mask[i, q, t_max + q] = True
    return features, ctx_pos, block_ids, block_pos, mask, labels


class DFlashTrainer(DraftTrainer):
    name = "DFlash drafter"

    def __init__(
        self,
        model: DFlashTrainModel,
        embed_weight: torch.Tensor,  # [vocab_size, H] the target's input embedding (with its multiplier)
        lm_head_weight: torch.Tensor,  # [vocab_size, H]
        train: FeatureData,
        held_out: FeatureData,
        cfg: TrainConfig,
        out_dir: str,
        logit_soft_cap: float | None = None,  # the target's final-logit soft cap
    ):
        super().__init__(model, train, held_out, cfg, out_dir)
        self.embed = embed_weight.float().to(self.device)
        self.lm_head = lm_head_weight.to(self.device, torch.bfloat16)
        self.logit_soft_cap = logit_soft_cap
        # The loss's vocabulary: its token ids [loss_vocab_size], their LM-head rows, and each
        # token id's index in it [vocab_size] (-100 for tokens outside).
        vocab = lm_head_weight.shape[0]
        full = cfg.loss_vocab == "full"
        self.loss_ids = (torch.arange(vocab) if full else train.label_ids()).to(self.device)
        self.loss_head = self.lm_head if full else self.lm_head[self.loss_ids]
        self.loss_index = torch.full((vocab,), -100, dtype=torch.int64, device=self.device)
        self.loss_index[self.loss_ids] = torch.arange(len(self.loss_ids), device=self.device)
        bs = model.config.block_size
        self.max_anchor = model.config.arch.max_position_embeddings - bs  # last block position < max
        self.pos_weight = torch.exp(-(torch.arange(bs) - 1).clamp(min=0) / cfg.loss_decay_gamma).to(self.device)  # [block_size]

    # ---- one step ----------------------------------------------------------------------------
    def _sample_batch(self):
        bs = self.model.config.block_size
        batch = []
        while len(batch) < self.cfg.seqs_per_step:
            tok, feat, argmax, p = self.train_data.get(self.rng.randrange(len(self.train_data.seqs)))
            # anchors in the continuation (the first sees its prompt), blocks inside the RoPE table
            lo, hi = max(1, p - 1), min(len(tok) - 2, self.max_anchor)
            if hi < lo:
                continue
            k = min(self.cfg.anchors_per_seq, hi - lo + 1)
            batch.append((tok, feat, argmax, sorted(self.rng.sample(range(lo, hi + 1), k))))
        return tuple(t.to(self.device) for t in build_blocks(batch, bs, self.model.config.mask_token_id))

    def _logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [rows, H] -> [rows, vocab] float32 through the frozen LM head (bfloat16 matmul)
        and the target's soft cap; ``lm_head``: some of its rows instead (``loss_head``)."""
        head = self.lm_head if lm_head is None else lm_head
        return soft_cap(F.linear(hidden.to(torch.bfloat16), head).float(), self.logit_soft_cap)

    def batch_loss(self) -> tuple[torch.Tensor, int]:
        features, ctx_pos, block_ids, block_pos, mask, labels = self._sample_batch()
        hidden = self.model(features, ctx_pos, F.embedding(block_ids, self.embed), block_pos, mask)  # [B, Q, H]
        valid = labels.view(-1) >= 0
        bs = self.model.config.block_size
        weights = self.pos_weight.repeat(labels.shape[1] // bs).expand_as(labels).reshape(-1)[valid]
        logits = self._logits(hidden.reshape(-1, hidden.shape[-1])[valid], self.loss_head)  # [rows, loss vocab]
        targets = self.loss_index[labels.view(-1)[valid]]
        loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum() / weights.sum()
        return loss, int(valid.sum())

    # ---- held-out acceptance -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_seqs: int | None = None) -> dict:
        """Held-out acceptance (k = block_size − 1; ``train/held_out_acceptance.py``)."""
        self.model.eval()
        bs = self.model.config.block_size
        scores = HeldOutAcceptance(bs - 1)
        n = len(self.held_out.seqs) if max_seqs is None else min(max_seqs, len(self.held_out.seqs))
        for i in range(n):
            tok, feat, argmax, p = self.held_out.get(i)
            anchors = list(range(max(1, p - 1), min(len(tok) - bs, self.max_anchor + 1)))
            if not anchors:
                continue
            ok = []
            for chunk in range(0, len(anchors), 32):
                blocks = build_blocks([(tok, feat, argmax, anchors[chunk : chunk + 32])], bs, self.model.config.mask_token_id)
                f, cp, ids, bp, mask, labels = (t.to(self.device) for t in blocks)
                hidden = self.model(f, cp, F.embedding(ids, self.embed), bp, mask)[0]  # [Q, H]
                pred = self._logits(hidden).argmax(-1).view(-1, bs)[:, 1:]  # [anchors, bs − 1]
                ok.append(pred == labels[0].view(-1, bs)[:, 1:])
            scores.add(torch.cat(ok).cpu())
        return scores.result()
