"""``tpspec train-draft``: the whole recipe that produces a drafter (DFlash, EAGLE-3 or MTP) for a target.

work_dir/
  generated/shard_*.pt        the target's greedy continuations of the training prompts
  features/shard_*.pt         target features and argmax labels on them
  text/, text_features/       real text (the code sources' files) and the same on it
  held_out_generated/, held_out_features/   the same for HumanEval (evaluation only)
  draft_vocab.json            EAGLE-3: the draft vocabulary's held-out coverage by size
  checkpoint.pt, learning_curve.json         training state (resume from here)
out_dir/                      the drafter in the method's public format (rewritten at each checkpoint)

Every stage resumes where it stopped: re-running the same command continues the job.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open

from tpspec.config import ModelArchConfig, read_config_json
from tpspec.models.loader.resolve import resolve_model
from tpspec.models.registry import get_model_class
from tpspec.spec_decode.speculator import FINAL_HIDDEN
from tpspec.train.data import code_prompts, code_texts, feature_shards, generate_shards, text_shards
from tpspec.train.dflash_module import DFlashTrainModel
from tpspec.train.recipe import DraftRecipe, TrainConfig
from tpspec.train.dflash_trainer import DFlashTrainer, init_from_target, new_dflash_config, qwen3_layer_view
from tpspec.train.eagle3_module import Eagle3TrainModel, new_eagle3_config
from tpspec.train.eagle3_trainer import Eagle3Trainer, choose_draft_vocab, draft_vocab_coverage
from tpspec.train.mtp_module import MTPTrainModel, new_mtp_config
from tpspec.train.mtp_trainer import MTPTrainer
from tpspec.train.trainer import DraftTrainer, FeatureData, resolve_train_device

logger = logging.getLogger(__name__)

# per device kind: the generation engine's step budget and KV cache, and tokens per feature forward
GENERATION_BATCHED_TOKENS = {"cpu": 4096, "cuda": 16384}
GENERATION_KV_CACHE_GB = {"cpu": 2.0, "cuda": 24.0}
FEATURE_BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}


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


def generation_shard_size(max_num_seqs: int) -> int:
    """Prompts per generated shard: at least 256, and enough to fill the engine's batch."""
    return max(256, max_num_seqs)


def _check_work_dir(work_dir: str, method: str, layer_ids: tuple[int, ...], feature_dtype: str, shard_size: int) -> None:
    """A work dir's features are one method's, from one set of target layers in one dtype, and its
    generated shards hold one number of prompts each (which prompts a shard holds): refuse another."""
    os.makedirs(work_dir, exist_ok=True)
    path = os.path.join(work_dir, "features.json")
    want = {"method": method, "target_layer_ids": list(layer_ids), "feature_dtype": feature_dtype,
            "generation_shard_size": shard_size}
    if os.path.exists(path):
        with open(path) as f:
            have = json.load(f)
        if have != want:
            raise ValueError(f"work dir {work_dir} holds features for {have}, not {want}: use another --work-dir")
    else:
        with open(path, "w") as f:
            json.dump(want, f)


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
    return build_trainer(work_dir, model, recipe, train_cfg, prompts, held_out_prompts).run(export_dir=out_dir)


def build_trainer(
    work_dir: str,
    model: str | None = None,
    recipe: DraftRecipe = DraftRecipe(),
    train_cfg: TrainConfig = TrainConfig(),
    prompts: list[str | list[int]] | None = None,
    held_out_prompts: list[str | list[int]] | None = None,
    generation_deadline: float | None = None,
) -> DraftTrainer:
    """Run (or resume) the data stages and return the method's trainer, not yet run.
    ``generation_deadline`` (``time.monotonic()``): generate no more training continuations after
    it, and train on the prompts whose continuations are there (a rerun generates the rest)."""
    target_folder = resolve_model(model)
    device = resolve_train_device(train_cfg.device)
    arch = ModelArchConfig.from_folder(target_folder)
    if recipe.method == "eagle3":
        aux = None if recipe.target_layer_ids is None else tuple(i + 1 for i in recipe.target_layer_ids)
        cfg = new_eagle3_config(arch, min(recipe.draft_vocab_size, arch.vocab_size), aux)
        layer_ids = cfg.fc_layers(arch.num_hidden_layers)
    elif recipe.method == "mtp":
        cfg = new_mtp_config(read_config_json(target_folder, "model folder"))
        layer_ids = (FINAL_HIDDEN,)
    else:
        layer_ids = recipe.target_layer_ids or spread_layer_ids(arch.num_hidden_layers)
        mask = recipe.mask_token_id if recipe.mask_token_id is not None else arch.vocab_size - 1
        cfg = new_dflash_config(arch, recipe.num_layers, layer_ids, recipe.block_size, mask)
    shard_size = generation_shard_size(recipe.max_num_seqs)
    _check_work_dir(work_dir, recipe.method, layer_ids, recipe.feature_dtype, shard_size)
    if prompts is None:
        prompts = code_prompts(recipe.code_sources)
    if recipe.num_prompts is not None:
        prompts = prompts[: recipe.num_prompts]
    if held_out_prompts is None:
        from tpspec.bench.datasets import humaneval_prompts

        held_out_prompts = humaneval_prompts()
    engine = dict(model=target_folder, dtype=recipe.generation_dtype, max_num_seqs=recipe.max_num_seqs, device=device.type,
                  max_num_batched_tokens=GENERATION_BATCHED_TOKENS[device.type], kv_cache_memory_gb=GENERATION_KV_CACHE_GB[device.type])
    features = dict(dtype=getattr(torch, recipe.feature_dtype), device=device, batch_tokens=FEATURE_BATCH_TOKENS[device.type])
    folders = {name: os.path.join(work_dir, name) for name in
               ("held_out_generated", "held_out_features", "generated", "features", "text", "text_features")}
    generate_shards(folders["held_out_generated"], held_out_prompts, max_tokens=recipe.max_tokens, engine_args=engine)
    feature_shards(folders["held_out_generated"], folders["held_out_features"], target_folder, layer_ids, **features)
    done = generate_shards(folders["generated"], prompts, shard_size=shard_size, max_tokens=recipe.max_tokens,
                           engine_args=engine, deadline=generation_deadline)
    if done < len(prompts):
        logger.info("training on the first %d of %d prompts' continuations (generation deadline)", done, len(prompts))
    feature_shards(folders["generated"], folders["features"], target_folder, layer_ids, **features)
    train_folders = [folders["features"]]
    if recipe.text_tokens:
        from tpspec.tokenizer import Tokenizer

        text_shards(folders["text"], code_texts(recipe.code_sources), Tokenizer.from_pretrained(target_folder), max_tokens=recipe.text_tokens)
        feature_shards(folders["text"], folders["text_features"], target_folder, layer_ids, **features)
        train_folders.append(folders["text_features"])
    train_data, held_out = FeatureData.load(*train_folders), FeatureData.load(folders["held_out_features"])
    logger.info("training on %d tokens in %d sequences", train_data.num_tokens(), len(train_data.seqs))

    # the draft's starting point: embedding, LM head and final norm, and the layers (dflash: the
    # last num_layers; mtp: the last, for its block)
    last = arch.num_hidden_layers - 1
    layers = {"eagle3": [], "mtp": [f"model.layers.{last}."], "dflash": ["model.layers."]}[recipe.method]
    state = _target_tensors(target_folder, ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", *layers])
    embed = state["model.embed_tokens.weight"]
    lm_head = state.get("lm_head.weight", embed)
    torch.manual_seed(train_cfg.seed)  # the draft's initial weights
    if recipe.method == "mtp":
        module = MTPTrainModel(cfg, read_config_json(target_folder, "model folder"))
        with torch.no_grad():
            module.shared_head.norm.weight.copy_(state["model.norm.weight"].float())
            if recipe.init_from_target:  # the block starts as the target's last decoder layer
                view = qwen3_layer_view(state, arch, last)
                for name, param in module.named_parameters():
                    if name in view:
                        param.copy_(view[name])
        return MTPTrainer(module, embed, lm_head, train_data, held_out, train_cfg, work_dir, recipe.chain_depth)
    if recipe.method == "eagle3":
        target_ids = choose_draft_vocab(train_data, arch.vocab_size, cfg.draft_vocab_size)
        sizes = sorted({2**i for i in range(11, 17) if 2**i < arch.vocab_size} | {cfg.draft_vocab_size, arch.vocab_size})
        with open(os.path.join(work_dir, "draft_vocab.json"), "w") as f:
            json.dump({"held_out_coverage": draft_vocab_coverage(train_data, held_out, arch.vocab_size, sizes)}, f, indent=1)
        head = Eagle3TrainModel(cfg, arch.num_hidden_layers, target_ids)
        with torch.no_grad():  # the draft LM head starts as the target's rows, its final norm as the target's
            head.lm_head.weight.copy_(lm_head[target_ids].float())
            head.norm.weight.copy_(state["model.norm.weight"].float() + get_model_class(arch.architecture).norm_weight_offset)
        return Eagle3Trainer(head, embed, train_data, held_out, train_cfg, work_dir, recipe.chain_depth)
    draft = DFlashTrainModel(cfg)
    if recipe.init_from_target:
        n = arch.num_hidden_layers
        init_from_target(draft, state, arch, list(range(n - recipe.num_layers, n)))
    return DFlashTrainer(
        draft, embed.float() * get_model_class(arch.architecture).embed_multiplier(arch), lm_head,
        train_data, held_out, train_cfg, work_dir, logit_soft_cap=arch.final_logit_softcapping,
    )
