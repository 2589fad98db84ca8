"""``train-draft --method mtp``: the module trained is the module served, in the layout vLLM reads.

* The training forward, unrolled as a drafter would run it, drafts exactly what the serving
  ``MTPProposer`` drafts from the exported checkpoint, and the step-0 logits of every row match.
* A run cut between checkpoints resumes to the uncut run's weights, bit for bit; the export holds
  only ``model.layers.{N}.*`` (no embedding, no head) beside the target's config with
  ``num_nextn_predict_layers: 1``.
* Training learns: on its own training data, acceptance far above the untrained module's, with the
  loss's softmax over the full vocabulary or over the tokens the target predicts in the data.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.models.test_eagle3 import _target
from tests.models.test_mtp import _engine_config, _final
from tests.train.cut_run import uncut_and_resumed
from tpspec.config import read_config_json
from tpspec.spec_decode.mtp import MTPProposer
from tpspec.train.mtp_module import MTPTrainModel, new_mtp_config
from tpspec.train.mtp_trainer import MTPTrainer
from tpspec.train.recipe import DraftRecipe, TrainConfig
from tpspec.train.train_draft import train_draft
from tests.drafting_utils import propose_drafts

K = 4


def _random_module(target_folder: str, seed: int = 0) -> MTPTrainModel:
    torch.manual_seed(seed)
    target_config = read_config_json(target_folder, "model folder")
    module = MTPTrainModel(new_mtp_config(target_config), target_config)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.normal_(1.0, 0.1)  # drafts far from ties
    return module.eval()


@torch.no_grad()
def _trained_chain(module, embed, head, features: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """The training forward run as a drafter: the chain from the last origin, fed its own drafts."""
    n = len(tokens) - 1
    drafts: list[int] = []
    for depth in range(1, k + 1):
        outs = module(features[None, :n], F.embedding(torch.tensor([tokens + drafts]), embed), depth)
        drafts.append(int((outs[-1][0, n - 1] @ head.T).argmax()))
    return drafts


def test_the_chain_trained_is_the_chain_the_serving_module_drafts(tiny_llama, tmp_path):
    module = _random_module(tiny_llama)
    folder = str(tmp_path / "mtp")
    module.save_pretrained(folder, dtype=torch.float32)
    tensors = load_file(f"{folder}/model.safetensors")
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_proj.weight",
            "model.layers.3.shared_head.norm.weight"} <= tensors.keys()
    assert all(k.startswith("model.layers.3.") for k in tensors)
    with open(f"{folder}/config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    target = _target(tiny_llama)
    config = _engine_config(tiny_llama, folder)
    spec = MTPProposer(config.speculative, config, torch.device("cpu"))
    spec.load(target, 96 * 4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (12, 7, 20)]
    tables = [[3 * j + i for j in range(17)] for i in range(3)]
    feats = [_final(target, t)[: len(t) - 1] for t in prompts]
    drafts = propose_drafts(spec, prompts, [0] * 3, tables, [True] * 3, [K] * 3, None, torch.cat(feats))
    embed, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()[:1000]  # unpadded
    for prompt, feat, drafted in zip(prompts, feats, drafts):
        assert len(drafted) == K and len(set(drafted)) > 1
        assert _trained_chain(module, embed, head, feat, prompt, K) == drafted
    n = len(prompts[2]) - 1
    with torch.inference_mode():
        normed, _ = spec._run(prompts[2][1:], list(range(n)), feats[2], [n], [tables[2]])
        serving = spec.model.compute_logits(normed)
    with torch.no_grad():
        trained = module(feats[2][None], F.embedding(torch.tensor([prompts[2]]), embed), 1)[0][0] @ head.T
    torch.testing.assert_close(trained, serving, rtol=1e-4, atol=1e-3)


PROMPTS = ["def add(a, b):", "The quick brown fox jumps over", [5, 6, 7, 8, 5, 6, 7, 8], "import os\nimport"]
RECIPE = DraftRecipe(method="mtp", chain_depth=3, max_tokens=48, generation_dtype="float32", max_num_seqs=4, text_tokens=0)
CFG = TrainConfig(steps=24, seqs_per_step=2, lr=3e-3, warmup_steps=4, checkpoint_every=5, eval_every=12)


def test_training_cut_at_any_moment_resumes_exactly(tiny_llama, tmp_path, monkeypatch):
    uncut, resumed, a, b = uncut_and_resumed(tmp_path, monkeypatch, tiny_llama, RECIPE, CFG, PROMPTS, PROMPTS[:1])
    assert uncut["step"] == CFG.steps
    assert resumed == {**uncut, "elapsed_s": resumed["elapsed_s"]}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.3.mtp_block.mlp.up_proj.weight" not in a and "model.layers.3.mlp.up_proj.weight" in a
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in a)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DraftRecipe(method="mtp", target_layer_ids=(1,))


@pytest.mark.parametrize("loss_vocab", ["full", "labels"])
def test_training_learns(loss_vocab, tiny_llama, tmp_path, monkeypatch):
    """On its own training data (held out = the training prompts), 150 steps lift acceptance far
    above the untrained module's."""
    trainers = []
    monkeypatch.setattr(MTPTrainer, "run", lambda self, export_dir=None: trainers.append(self) or {})
    cfg = dataclasses.replace(CFG, steps=150, seqs_per_step=4, lr=3e-3, loss_vocab=loss_vocab)
    train_draft(str(tmp_path / "w"), str(tmp_path / "out"), tiny_llama, RECIPE, cfg, PROMPTS, PROMPTS)
    (trainer,) = trainers
    if loss_vocab == "labels":
        assert len(trainer.class_head) < 1000
    before = trainer.evaluate()
    for _ in range(cfg.steps):
        trainer.train_step()
    after = trainer.evaluate()
    assert before["anchors"] == after["anchors"] > 50
    assert before["acceptance_length"] < 1.3
    assert after["acceptance_length"] > before["acceptance_length"] + 1.0, (before, after)
