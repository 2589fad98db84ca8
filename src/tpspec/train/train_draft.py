"""``tpspec train-draft``: the whole recipe that produces a DFlash drafter for a target model.

work_dir/
  generated/shard_*.pt        the target's greedy continuations of the training prompts
  features/shard_*.pt         target features, final hidden states and argmax labels on them
  text/, text_features/       real text (standard-library sources) and the same on it
  held_out_generated/, held_out_features/   the same for HumanEval (evaluation only)
  checkpoint.pt, learning_curve.json         training state (resume from here)
out_dir/                      the drafter in the public DFlash format (rewritten at each checkpoint)

Every stage resumes where it stopped: re-running the same command continues the job.
"""

from __future__ import annotations

import logging
import os

import torch
from safetensors import safe_open

from tpspec.config import ModelArchConfig
from tpspec.models.loader.resolve import resolve_model
from tpspec.models.registry import get_model_class
from tpspec.train.data import feature_shards, generate_shards, stdlib_prompts, stdlib_sources, text_shards
from tpspec.train.dflash_module import DFlashTrainModel
from tpspec.train.recipe import DraftRecipe, TrainConfig
from tpspec.train.dflash_trainer import DFlashTrainer, init_from_target, new_dflash_config
from tpspec.train.trainer import FeatureData

logger = logging.getLogger(__name__)


def spread_layer_ids(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """n layer ids from layer 1 to the last, evenly spaced (e.g. 30 layers → 1, 8, 15, 22, 29)."""
    if n == 1:
        return (num_target_layers - 1,)
    return tuple(round(1 + i * (num_target_layers - 2) / (n - 1)) for i in range(n))


def _target_tensors(folder: str, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                for name in st.keys():
                    if any(name == n or name.startswith(n) for n in names):
                        out[name] = st.get_tensor(name)
    return out


def train_draft(
    work_dir: str,
    out_dir: str,
    model: str | None = None,
    recipe: DraftRecipe = DraftRecipe(),
    train_cfg: TrainConfig = TrainConfig(),
    prompts: list[str | list[int]] | None = None,
    held_out_prompts: list[str | list[int]] | None = None,
) -> dict:
    """Run (or resume) every stage; returns the last learning-curve point."""
    target_folder = resolve_model(model)
    arch = ModelArchConfig.from_folder(target_folder)
    layer_ids = recipe.target_layer_ids or spread_layer_ids(arch.num_hidden_layers)
    mask = recipe.mask_token_id if recipe.mask_token_id is not None else arch.vocab_size - 1
    cfg = new_dflash_config(arch, recipe.num_layers, layer_ids, recipe.block_size, mask)
    if prompts is None:
        prompts = stdlib_prompts()
    if recipe.num_prompts is not None:
        prompts = prompts[: recipe.num_prompts]
    if held_out_prompts is None:
        from tpspec.bench.datasets import humaneval_prompts

        held_out_prompts = humaneval_prompts()
    engine = dict(model=target_folder, dtype=recipe.generation_dtype, max_num_seqs=recipe.max_num_seqs,
                  max_num_batched_tokens=4096, kv_cache_memory_gb=2.0)
    folders = {name: os.path.join(work_dir, name) for name in
               ("held_out_generated", "held_out_features", "generated", "features", "text", "text_features")}
    generate_shards(folders["held_out_generated"], held_out_prompts, max_tokens=recipe.max_tokens, engine_args=engine)
    feature_shards(folders["held_out_generated"], folders["held_out_features"], target_folder, layer_ids)
    generate_shards(folders["generated"], prompts, max_tokens=recipe.max_tokens, engine_args=engine)
    feature_shards(folders["generated"], folders["features"], target_folder, layer_ids)
    train_folders = [folders["features"]]
    if recipe.text_tokens:
        from tpspec.tokenizer import Tokenizer

        text_shards(folders["text"], stdlib_sources(), Tokenizer.from_pretrained(target_folder), max_tokens=recipe.text_tokens)
        feature_shards(folders["text"], folders["text_features"], target_folder, layer_ids)
        train_folders.append(folders["text_features"])

    torch.manual_seed(train_cfg.seed)  # the draft's initial weights
    draft = DFlashTrainModel(cfg)
    state = _target_tensors(target_folder, ["model.embed_tokens.weight", "lm_head.weight", "model.layers."])
    embed = state["model.embed_tokens.weight"]
    lm_head = state.get("lm_head.weight", embed)
    if recipe.init_from_target:
        n = arch.num_hidden_layers
        init_from_target(draft, state, arch, list(range(n - recipe.num_layers, n)))
    trainer = DFlashTrainer(
        draft, embed.float() * get_model_class(arch.architecture).embed_multiplier(arch), lm_head,
        FeatureData.load(*train_folders),
        FeatureData.load(folders["held_out_features"]),
        train_cfg, work_dir, logit_soft_cap=arch.final_logit_softcapping,
    )
    logger.info("training on %d tokens in %d sequences", trainer.train_data.num_tokens(), len(trainer.train_data.seqs))
    return trainer.run(export_dir=out_dir)
