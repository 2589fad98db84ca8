"""EAGLE-3 training: the chain the trainer unrolls is the chain the serving head drafts, labels stop
where the data leaves the target's greedy chain, the draft vocabulary is the target's most
predicted tokens, a cut run resumes exactly, and training learns (held-out acceptance far above
an untrained head's)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.models.test_eagle3 import _captured, _engine_config, _target
from tests.train.cut_run import uncut_and_resumed
from tpspec.config import ModelArchConfig
from tpspec.spec_decode.eagle import Eagle3Proposer
from tpspec.train.eagle3_module import Eagle3TrainModel, new_eagle3_config
from tpspec.train.chain_trainer import build_chain_batch
from tpspec.train.eagle3_trainer import Eagle3Trainer, choose_draft_vocab
from tpspec.train.recipe import DraftRecipe, TrainConfig
from tpspec.train.train_draft import train_draft
from tpspec.train.trainer import FeatureData
from tests.drafting_utils import propose_drafts

LAYERS = (1, 0, 1)  # tpspec layer ids (outputs of layers 1, 0, 1): the tiny target has 3 layers
K = 4


def _random_head(target_folder: str, seed: int = 0) -> Eagle3TrainModel:
    arch = ModelArchConfig.from_folder(target_folder)
    torch.manual_seed(seed)
    target_ids = torch.randperm(arch.vocab_size)[:500].sort().values
    head = Eagle3TrainModel(new_eagle3_config(arch, 500, tuple(i + 1 for i in LAYERS)), arch.num_hidden_layers, target_ids)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # drafts far from ties
    return head.eval()


@torch.no_grad()
def _trained_chain(head: Eagle3TrainModel, embed: torch.Tensor, features: torch.Tensor, tokens: list[int], k: int):
    """The training forward run as a drafter: the chain from the last origin, fed its own drafts."""
    n = len(tokens) - 1  # rows 0 … n − 1; origin n − 1 drafts tokens n + 1 …
    drafts: list[int] = []
    for depth in range(1, k + 1):
        ids = torch.tensor([tokens + drafts])  # [1, n + depth]
        outs = head(features[None, :n], F.embedding(ids, embed), depth)
        drafts.append(int(head.target_ids[head.lm_head(outs[-1][0, n - 1]).argmax()]))
    return drafts


def test_the_chain_trained_is_the_chain_the_serving_head_drafts(tiny_llama, tmp_path):
    head = _random_head(tiny_llama)
    folder = str(tmp_path / "head")
    head.save_pretrained(folder, dtype=torch.float32)
    tensors = load_file(f"{folder}/model.safetensors")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"} <= tensors.keys()
    target = _target(tiny_llama)
    config = _engine_config(tiny_llama, folder)
    spec = Eagle3Proposer(config.speculative, config, torch.device("cpu"))
    assert spec.capture_layers == LAYERS
    spec.load(target, 96 * 4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (12, 7, 20)]
    tables = [[3 * j + i for j in range(17)] for i in range(3)]
    feats = [_captured(target, t, LAYERS)[: len(t) - 1] for t in prompts]
    drafts = propose_drafts(spec, prompts, [0] * 3, tables, [True] * 3, [K] * 3, None, torch.cat(feats))
    embed = target.embed_tokens.weight.detach()
    for prompt, feat, drafted in zip(prompts, feats, drafts):
        assert len(drafted) == K
        assert _trained_chain(head, embed, feat, prompt, K) == drafted
    # and step 0's logits on every row are the serving head's on its refed rows
    n = len(prompts[2]) - 1
    with torch.inference_mode():
        normed, _ = spec._run(prompts[2][1:], list(range(n)), spec.model.combine_hidden_states(feats[2]), [n], [tables[2]])
        serving = spec.model.compute_logits(normed)[:, head.target_ids]
    with torch.no_grad():
        trained = head.lm_head(head(feats[2][None], F.embedding(torch.tensor([prompts[2]]), embed), 1)[0][0])
    torch.testing.assert_close(trained, serving, rtol=1e-4, atol=1e-3)


def test_chain_labels_follow_the_greedy_chain():
    tok = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    # argmax[s] = the target's prediction of token s + 1; the text leaves the chain at token 4
    argmax = torch.tensor([11, 12, 13, 99, 15, 16, 17])
    features, ids, labels = build_chain_batch([(tok, torch.randn(7, 6), argmax)], depth=3)
    assert ids[0].tolist() == tok.tolist() + [0, 0, 0]
    # step 0, row t: token t + 2 = argmax[t + 1], always labelled (no fed draft yet)
    assert labels[0, 0].tolist() == [12, 13, 99, 15, 16, 17, -100]
    # step 1, row t was fed token t + 2, which must be argmax[t + 1]: fails for t = 2 (token 4 ≠ 99)
    assert labels[1, 0].tolist() == [13, 99, -100, 16, 17, -100, -100]
    # step 2 also needs token t + 3 == argmax[t + 2]: fails for t = 1 and 2
    assert labels[2, 0].tolist() == [99, -100, -100, 17, -100, -100, -100]


def test_the_draft_vocabulary_is_the_most_predicted_tokens():
    shard = {"tokens": torch.zeros(6, dtype=torch.int32), "seq_lens": torch.tensor([6]), "prompt_lens": torch.tensor([0]),
             "features": torch.zeros(6, 2),
             "argmax": torch.tensor([7, 3, 7, 3, 7, 9], dtype=torch.int32)}
    assert choose_draft_vocab(FeatureData([shard]), 10, 2).tolist() == [3, 7]


def test_a_resumed_head_keeps_its_draft_vocabulary(tiny_llama, tmp_path):
    """Data grown since the checkpoint choose another vocabulary; the resumed head keeps its own,
    and the labels map through it."""
    saved, fresh = _random_head(tiny_llama, seed=0), _random_head(tiny_llama, seed=1)
    assert not torch.equal(saved.target_ids, fresh.target_ids)
    vocab = ModelArchConfig.from_folder(tiny_llama).vocab_size
    data = FeatureData([{"tokens": torch.zeros(4, dtype=torch.int32), "seq_lens": torch.tensor([4]),
                         "prompt_lens": torch.tensor([0]), "features": torch.zeros(4, 2),
                         "argmax": torch.zeros(4, dtype=torch.int32)}])
    embed = torch.zeros(vocab, 8)
    Eagle3Trainer(saved, embed, data, data, CFG, str(tmp_path), depth=2).save_checkpoint()
    resumed = Eagle3Trainer(fresh, embed, data, data, CFG, str(tmp_path), depth=2)
    assert resumed.maybe_resume()
    assert torch.equal(resumed.model.target_ids, saved.target_ids)
    assert resumed.draft_index[saved.target_ids].tolist() == list(range(500))
    assert int((resumed.draft_index >= 0).sum()) == 500


PROMPTS = ["def add(a, b):", "The quick brown fox jumps over", [5, 6, 7, 8, 5, 6, 7, 8], "import os\nimport"]
RECIPE = DraftRecipe(method="eagle3", target_layer_ids=LAYERS, draft_vocab_size=600, chain_depth=3, max_tokens=48,
                     generation_dtype="float32", max_num_seqs=4, text_tokens=0)
CFG = TrainConfig(steps=24, seqs_per_step=2, lr=3e-3, warmup_steps=4, checkpoint_every=5, eval_every=12)


def test_training_cut_at_any_moment_resumes_exactly(tiny_llama, tmp_path, monkeypatch):
    uncut, resumed, a, b = uncut_and_resumed(tmp_path, monkeypatch, tiny_llama, RECIPE, CFG, PROMPTS, PROMPTS[:1])
    assert uncut["step"] == CFG.steps
    assert resumed == {**uncut, "elapsed_s": resumed["elapsed_s"]}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with open(tmp_path / "a-out" / "config.json") as f:
        assert json.load(f)["eagle_aux_hidden_state_layer_ids"] == [2, 1, 2]
    with open(tmp_path / "a" / "draft_vocab.json") as f:
        coverage = json.load(f)["held_out_coverage"]
    assert coverage["1000"] == 1.0 and 0 < coverage["600"] <= 1.0
    # a work dir is one method's: another method's features are refused
    with pytest.raises(ValueError, match="work dir"):
        train_draft(str(tmp_path / "a"), str(tmp_path / "c-out"), tiny_llama, DraftRecipe(method="dflash"), CFG, PROMPTS, PROMPTS[:1])


def test_training_learns(tiny_llama, tmp_path, monkeypatch):
    """On its own training data (held out = the training prompts), 150 steps lift acceptance far
    above the untrained head's."""
    trainers = []
    monkeypatch.setattr(Eagle3Trainer, "run", lambda self, export_dir=None: trainers.append(self) or {})
    cfg = dataclasses.replace(CFG, steps=150, seqs_per_step=4, lr=3e-3)
    train_draft(str(tmp_path / "w"), str(tmp_path / "out"), tiny_llama, RECIPE, cfg, PROMPTS, PROMPTS)
    (trainer,) = trainers
    before = trainer.evaluate()
    for _ in range(cfg.steps):
        trainer.train_step()
    after = trainer.evaluate()
    assert before["anchors"] == after["anchors"] > 50
    assert before["acceptance_length"] < 1.3
    assert after["acceptance_length"] > before["acceptance_length"] + 1.0, (before, after)
