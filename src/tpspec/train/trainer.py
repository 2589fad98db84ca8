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

import dataclasses
import json
import logging
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tpspec.config import ModelArchConfig
from tpspec.layers.logits import soft_cap
from tpspec.models.dflash import DFLASH_ARCHITECTURE, DFlashConfig
from tpspec.models.registry import get_model_class
from tpspec.train.dflash_module import DFlashTrainModel
from tpspec.train.recipe import TrainConfig

logger = logging.getLogger(__name__)


def new_dflash_config(
    target: ModelArchConfig, num_layers: int, target_layer_ids: tuple[int, ...], block_size: int, mask_token_id: int
) -> DFlashConfig:
    """A drafter shaped like the target's layers, ``num_layers`` deep, in the public layout's
    Qwen3 style (q/k norms, SiLU, full attention, one RoPE base) whatever the target's style."""
    arch = dataclasses.replace(
        target, architecture=DFLASH_ARCHITECTURE, num_hidden_layers=num_layers, tie_word_embeddings=False,
        layer_types=None, sliding_window=None, rope_local_theta=None, query_pre_attn_scalar=None,
        final_logit_softcapping=None, hidden_activation="silu",
    )
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


class FeatureData:
    """All sequences of the feature shards in memory: tokens, features, argmax labels."""

    def __init__(self, shards: list[dict]):
        self.seqs: list[tuple[int, int, int, int]] = []  # (shard, start, length, prompt_len)
        self.shards = shards
        for s, shard in enumerate(shards):
            start = 0
            for n, p in zip(shard["seq_lens"].tolist(), shard["prompt_lens"].tolist()):
                self.seqs.append((s, start, n, p))
                start += n

    @classmethod
    def load(cls, *folders: str) -> "FeatureData":
        shards = []
        for folder in folders:
            names = sorted(f for f in os.listdir(folder) if f.startswith("shard_") and f.endswith(".pt"))
            shards += [torch.load(os.path.join(folder, n)) for n in names]
        return cls(shards)

    def label_ids(self) -> torch.Tensor:
        """The distinct token ids the target predicts anywhere in this data, sorted: [n]."""
        return torch.unique(torch.cat([shard["argmax"].long() for shard in self.shards]))

    def num_tokens(self) -> int:
        return sum(n for _, _, n, _ in self.seqs)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        s, start, n, p = self.seqs[i]
        shard = self.shards[s]
        sl = slice(start, start + n)
        return shard["tokens"][sl].long(), shard["features"][sl], shard["argmax"][sl].long(), p


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


class DFlashTrainer:
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
        self.model, self.cfg, self.out_dir = model, cfg, out_dir
        self.embed = embed_weight.float()
        self.lm_head = lm_head_weight.to(torch.bfloat16)
        self.logit_soft_cap = logit_soft_cap
        # The loss's vocabulary: its token ids [loss_vocab_size], their LM-head rows, and each
        # token id's index in it [vocab_size] (-100 for tokens outside).
        vocab = lm_head_weight.shape[0]
        full = cfg.loss_vocab == "full"
        self.loss_ids = torch.arange(vocab) if full else train.label_ids()
        self.loss_head = self.lm_head if full else self.lm_head[self.loss_ids]
        self.loss_index = torch.full((vocab,), -100, dtype=torch.int64)
        self.loss_index[self.loss_ids] = torch.arange(len(self.loss_ids))
        self.train_data, self.held_out = train, held_out
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = 0
        self.tokens_seen = 0
        self.loss_avg: float | None = None  # running mean of the training loss
        self.curve: list[dict] = []
        self.rng = random.Random(cfg.seed)
        bs = model.config.block_size
        self.max_anchor = model.config.arch.max_position_embeddings - bs  # last block position < max
        self.pos_weight = torch.exp(-(torch.arange(bs) - 1).clamp(min=0) / cfg.loss_decay_gamma)  # [block_size]

    # ---- checkpoints -------------------------------------------------------------------------
    def _ckpt_path(self) -> str:
        return os.path.join(self.out_dir, "checkpoint.pt")

    def save_checkpoint(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        tmp = self._ckpt_path() + ".tmp"
        torch.save(
            {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
             "tokens_seen": self.tokens_seen, "loss_avg": self.loss_avg, "curve": self.curve, "rng": self.rng.getstate(),
             "torch_rng": torch.get_rng_state()},
            tmp,
        )
        os.replace(tmp, self._ckpt_path())
        with open(os.path.join(self.out_dir, "learning_curve.json"), "w") as f:
            json.dump(self.curve, f, indent=1)

    def maybe_resume(self) -> bool:
        if not os.path.exists(self._ckpt_path()):
            return False
        ck = torch.load(self._ckpt_path(), weights_only=False)
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.step, self.tokens_seen, self.curve = ck["step"], ck["tokens_seen"], ck["curve"]
        self.loss_avg = ck["loss_avg"]
        self.rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"])
        logger.info("resumed at step %d (%d training tokens)", self.step, self.tokens_seen)
        return True

    # ---- one step ----------------------------------------------------------------------------
    def _lr(self) -> float:
        c = self.cfg
        if self.step < c.warmup_steps:
            return c.lr * (self.step + 1) / c.warmup_steps
        progress = (self.step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

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
        return build_blocks(batch, bs, self.model.config.mask_token_id)

    def _logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [rows, H] -> [rows, vocab] float32 through the frozen LM head (bfloat16 matmul)
        and the target's soft cap; ``lm_head``: some of its rows instead (``loss_head``)."""
        head = self.lm_head if lm_head is None else lm_head
        return soft_cap(F.linear(hidden.to(torch.bfloat16), head).float(), self.logit_soft_cap)

    def train_step(self) -> float:
        features, ctx_pos, block_ids, block_pos, mask, labels = self._sample_batch()
        self.model.train()
        hidden = self.model(features, ctx_pos, F.embedding(block_ids, self.embed), block_pos, mask)  # [B, Q, H]
        valid = labels.view(-1) >= 0
        bs = self.model.config.block_size
        weights = self.pos_weight.repeat(labels.shape[1] // bs).expand_as(labels).reshape(-1)[valid]
        logits = self._logits(hidden.reshape(-1, hidden.shape[-1])[valid], self.loss_head)  # [rows, loss vocab]
        targets = self.loss_index[labels.view(-1)[valid]]
        loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum() / weights.sum()
        for g in self.opt.param_groups:
            g["lr"] = self._lr()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.tokens_seen += int(valid.sum())
        return float(loss.detach())

    # ---- held-out acceptance -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_seqs: int | None = None, stride: int = 4) -> dict:
        """Mean acceptance length (k = block_size − 1) and per-position accuracy on held-out data."""
        self.model.eval()
        bs = self.model.config.block_size
        lengths, correct, counted = [], torch.zeros(bs - 1), torch.zeros(bs - 1)
        n = len(self.held_out.seqs) if max_seqs is None else min(max_seqs, len(self.held_out.seqs))
        for i in range(n):
            tok, feat, argmax, p = self.held_out.get(i)
            anchors = list(range(max(1, p - 1), min(len(tok) - bs, self.max_anchor + 1), stride))
            if not anchors:
                continue
            for chunk in range(0, len(anchors), 32):
                f, cp, ids, bp, mask, labels = build_blocks([(tok, feat, argmax, anchors[chunk : chunk + 32])], bs, self.model.config.mask_token_id)
                hidden = self.model(f, cp, F.embedding(ids, self.embed), bp, mask)[0]  # [Q, H]
                pred = self._logits(hidden).argmax(-1).view(-1, bs)[:, 1:]  # [anchors, bs − 1]
                ok = pred == labels[0].view(-1, bs)[:, 1:]
                correct += ok.float().sum(0)
                counted += ok.shape[0]
                run = ok.long().cumprod(dim=1).sum(dim=1)  # leading drafts accepted
                lengths += (1 + run).tolist()
        return {
            "acceptance_length": sum(lengths) / max(1, len(lengths)),
            "position_accuracy": (correct / counted.clamp(min=1)).tolist(),
            "anchors": len(lengths),
        }

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, export_dir: str | None = None, eval_seqs: int | None = 32) -> dict:
        self.maybe_resume()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="training DFlash drafter")
        last = self.curve[-1] if self.curve else {}
        t0 = time.perf_counter()
        while self.step < self.cfg.steps:
            loss = self.train_step()
            self.loss_avg = loss if self.loss_avg is None else 0.95 * self.loss_avg + 0.05 * loss
            bar.update(1)
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                ev = self.evaluate(eval_seqs)
                last = {"step": self.step, "training_tokens": self.tokens_seen, "loss": self.loss_avg,
                        "held_out_acceptance_length": ev["acceptance_length"],
                        "first_position_accuracy": ev["position_accuracy"][0],
                        "elapsed_s": time.perf_counter() - t0}
                self.curve.append(last)
                logger.info("step %d: %s", self.step, last)
            bar.set_postfix(loss=f"{self.loss_avg:.3f}", held_out_al=f"{last.get('held_out_acceptance_length', float('nan')):.3f}")
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
                if export_dir is not None:
                    self.model.save_pretrained(export_dir)
        bar.close()
        return last
