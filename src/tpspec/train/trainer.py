"""What every drafter's training shares: the feature data in memory, the optimizer and its
schedule, checkpoints that resume a cut run to exactly the weights of an uncut one, the loop with
its progress bar, and the learning curve (held-out acceptance against training tokens).

A method subclasses ``DraftTrainer`` with ``batch_loss`` (one batch's loss) and ``evaluate``
(held-out acceptance); its model has ``save_pretrained(folder)`` in the method's public layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time

import torch
from tqdm import tqdm

from tpspec.train.recipe import TrainConfig

logger = logging.getLogger(__name__)


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


def resolve_train_device(option: str) -> torch.device:
    """``TrainConfig.device`` -> the device every stage runs on."""
    if option == "auto":
        option = "cuda" if torch.cuda.is_available() else "cpu"
    if option == "cuda" and not torch.cuda.is_available():
        raise ValueError("train config device='cuda' but no CUDA device is available")
    return torch.device(option)


def resolve_autocast(option: str, device: torch.device) -> torch.dtype | None:
    """``TrainConfig.autocast`` -> the autocast dtype of the training step, None for float32
    ("auto": bfloat16 on CUDA, and on a CPU that multiplies it natively)."""
    if option == "auto" and device.type == "cuda":
        return torch.bfloat16
    if option == "auto":
        from tpspec.cpu_features import BFLOAT16_ISA, cpu_model_and_isa

        option = "bfloat16" if any(f in cpu_model_and_isa()[1] for f in BFLOAT16_ISA) else "none"
    return torch.bfloat16 if option == "bfloat16" else None


class DraftTrainer:
    name = "drafter"  # for the progress bar

    def __init__(self, model: torch.nn.Module, train: FeatureData, held_out: FeatureData, cfg: TrainConfig, out_dir: str):
        self.device = resolve_train_device(cfg.device)
        self.model, self.cfg, self.out_dir = model.to(self.device), cfg, out_dir
        self.train_data, self.held_out = train, held_out
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.step = 0
        self.tokens_seen = 0
        self.loss_avg: float | None = None  # running mean of the training loss
        self.curve: list[dict] = []
        self.rng = random.Random(cfg.seed)
        self.autocast = resolve_autocast(cfg.autocast, self.device)

    # ---- what a method defines ---------------------------------------------------------------
    def batch_loss(self) -> tuple[torch.Tensor, int]:
        """Draw one batch; returns its loss (scalar, with grad) and its number of labelled tokens."""
        raise NotImplementedError

    def evaluate(self, max_seqs: int | None = None) -> dict:
        """Held-out acceptance, ``HeldOutAcceptance.result()``."""
        raise NotImplementedError

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
        ck = torch.load(self._ckpt_path(), weights_only=False, map_location=self.device)
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.step, self.tokens_seen, self.curve = ck["step"], ck["tokens_seen"], ck["curve"]
        self.loss_avg = ck["loss_avg"]
        self.rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"].cpu())
        logger.info("resumed at step %d (%d training tokens)", self.step, self.tokens_seen)
        return True

    # ---- one step ----------------------------------------------------------------------------
    def _lr(self) -> float:
        c = self.cfg
        if self.step < c.warmup_steps:
            return c.lr * (self.step + 1) / c.warmup_steps
        progress = (self.step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> float:
        self.model.train()
        with contextlib.nullcontext() if self.autocast is None else torch.autocast(self.device.type, dtype=self.autocast):
            loss, tokens = self.batch_loss()
        for g in self.opt.param_groups:
            g["lr"] = self._lr()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.tokens_seen += tokens
        return float(loss.detach())

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, export_dir: str | None = None, eval_seqs: int | None = 32, deadline: float | None = None) -> dict:
        """Train to ``cfg.steps`` (resuming a checkpoint); ``deadline`` (``time.monotonic()``): stop
        at the first step after it, evaluated, checkpointed and exported, as a rerun resumes it."""
        self.maybe_resume()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"training {self.name}")
        last = self.curve[-1] if self.curve else {}
        t0 = time.perf_counter()
        while self.step < self.cfg.steps:
            loss = self.train_step()
            self.loss_avg = loss if self.loss_avg is None else 0.95 * self.loss_avg + 0.05 * loss
            bar.update(1)
            stop = self.step == self.cfg.steps or (deadline is not None and time.monotonic() > deadline)
            if self.step % self.cfg.eval_every == 0 or stop:
                ev = self.evaluate(eval_seqs)
                last = {"step": self.step, "training_tokens": self.tokens_seen, "loss": self.loss_avg,
                        "held_out_acceptance_length": ev["acceptance_length"],
                        "held_out_acceptance_length_all_origins": ev["acceptance_length_all_origins"],
                        "first_draft_acceptance": ev["position_acceptance"][0],
                        "elapsed_s": time.perf_counter() - t0}
                self.curve.append(last)
                logger.info("step %d: %s", self.step, last)
            bar.set_postfix(loss=f"{self.loss_avg:.3f}", held_out_al=f"{last.get('held_out_acceptance_length', float('nan')):.3f}")
            if self.step % self.cfg.checkpoint_every == 0 or stop:
                self.save_checkpoint()
                if export_dir is not None:
                    self.model.save_pretrained(export_dir)
            if stop:
                break
        bar.close()
        return last
