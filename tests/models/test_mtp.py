"""MTP modules (``method: mtp``) on tiny random checkpoints in the DeepSeek-V3 layout vLLM reads.

* The drafter's drafts (and the logits of every refed row) equal an independent reference: plain
  torch written from the public description, fed the target's final hidden state from Hugging
  Face (``hidden_states[-1]``, after the final norm), with the embedding at position 0 zeroed.
  Two rounds: the second accepts some drafts and refeeds over the chained KV; a partial prefill
  chunk sits in the batch; a sequence near max_model_len gets fewer drafts. Variants: a
  standalone module borrowing the target's LM head; a whole target checkpoint holding its MTP
  layer (with its own ``embed_tokens``, skipped) and a shipped ``shared_head.head``.
* Bad configs and checkpoints raise ValueError naming the field or tensor.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.models.test_eagle3 import _rms, _rope, _target
from tpspec.config import CacheConfig, EngineConfig, ModelArchConfig, SchedulerConfig, SpeculativeConfig
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.mtp import MTPConfig, MTPModel
from tpspec.spec_decode.mtp import MTPProposer
from tpspec.spec_decode.speculator import FINAL_HIDDEN
from tests.drafting_utils import propose_drafts

VOCAB = 1000
K = 4
BLOCK = 4
MAX_LEN = 64
TARGET_LAYERS = 3  # the tiny target's: MTP layer i is model.layers.{3 + i}


def mtp_tensors(cfg: dict, seed: int, num_layers: int = 1, ship_head: bool = False) -> dict[str, torch.Tensor]:
    """Random MTP layers for a target of config ``cfg``, at ``model.layers.{N + i}``."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def mat(rows, cols, std=0.15):
        return torch.randn(rows, cols, generator=g) * std

    def norm(n=h):
        return 1 + 0.1 * torch.randn(n, generator=g)

    tensors = {}
    for i in range(num_layers):
        p = f"model.layers.{cfg['num_hidden_layers'] + i}."
        tensors.update({
            p + "enorm.weight": norm(), p + "hnorm.weight": norm(), p + "eh_proj.weight": mat(h, 2 * h, 0.1),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
            p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter), p + "shared_head.norm.weight": norm(),
        })
        if cfg.get("model_type") == "qwen3":
            tensors.update({p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)})
        if ship_head:
            tensors[p + "shared_head.head.weight"] = mat(cfg["vocab_size"], h, 0.3)
    return tensors


def write_mtp(folder: str, target: str, seed: int = 0, num_layers: int = 1, ship_head: bool = False,
              whole_target: bool = False, **config) -> str:
    """An MTP checkpoint for ``target``: its config.json plus ``num_nextn_predict_layers`` (``config``
    overrides fields), holding only the MTP layers or (``whole_target``) the target's tensors too,
    each MTP layer with its own copy of the embedding, as DeepSeek-V3 ships them (a model folder,
    tokenizer included)."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg = dict(cfg, num_nextn_predict_layers=num_layers)
    tensors = mtp_tensors(cfg, seed, num_layers, ship_head)
    if whole_target:
        own = load_file(os.path.join(target, "model.safetensors"))
        tensors.update(own)
        for i in range(num_layers):
            tensors[f"model.layers.{cfg['num_hidden_layers'] + i}.embed_tokens.weight"] = torch.randn(VOCAB, cfg["hidden_size"])
    cfg.update(config)
    if whole_target:  # a model folder: the tokenizer too
        shutil.copytree(target, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


class _Reference:
    """One MTP layer in float64 over whole sequences (no cache): row t = (final hidden at t, token t + 1)."""

    def __init__(self, folder: str, target_folder: str):
        import transformers

        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = json.load(f)
        w = load_file(os.path.join(folder, "model.safetensors"))
        p = f"model.layers.{self.cfg['num_hidden_layers']}."
        self.w = {k[len(p):]: v.double() for k, v in w.items() if k.startswith(p)}
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(target_folder, torch_dtype=torch.float64).eval()
        self.embed = self.hf.model.embed_tokens.weight.detach()
        self.head = self.w.get("shared_head.head.weight", self.hf.lm_head.weight.detach())

    def final_hidden(self, tokens: list[int]) -> torch.Tensor:  # [T, H], after the final norm
        with torch.no_grad():
            return self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]

    def layer(self, tokens_next: list[int], hidden, pos):
        w, c = self.w, self.cfg
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        e = self.embed[torch.tensor(tokens_next)] * (pos != 0)[:, None]
        x = torch.cat([_rms(e, w["enorm.weight"]), _rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        a = _rms(x, w["input_layernorm.weight"])
        q = _rope((a @ w["self_attn.q_proj.weight"].T).view(-1, nh, d), pos)
        k = _rope((a @ w["self_attn.k_proj.weight"].T).view(-1, nkv, d), pos)
        v = (a @ w["self_attn.v_proj.weight"].T).view(-1, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        causal = torch.ones(len(pos), len(pos), dtype=torch.bool).tril()
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).reshape(len(pos), -1)
        h = attn @ w["self_attn.o_proj.weight"].T + x
        m = _rms(h, w["post_attention_layernorm.weight"])
        out = (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T + h
        return _rms(out, w["shared_head.norm.weight"]), out

    def run(self, tokens: list[int], k: int) -> tuple[torch.Tensor, list[int]]:
        """Logits of rows 0 … n − 1 of ``tokens`` (x_0 … x_n) and the k greedy chain drafts."""
        n = len(tokens) - 1
        hidden = self.final_hidden(tokens)[:n]
        fed = tokens[1:]
        normed, prenorm = self.layer(fed, hidden, torch.arange(n))
        row_logits, drafts = normed @ self.head.T, []
        for _ in range(k):
            drafts.append(int((normed[-1] @ self.head.T).argmax()))
            hidden = torch.cat([hidden, prenorm[-1:]])
            fed = fed + drafts[-1:]
            normed, prenorm = self.layer(fed, hidden, torch.arange(len(fed)))
        return row_logits, drafts


def _engine_config(target: str, draft: str, **spec) -> EngineConfig:
    return EngineConfig(
        model=target, arch=ModelArchConfig.from_folder(target),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=96, kv_cache_dtype="float32"),  # against a float32 reference
        scheduler=SchedulerConfig(max_model_len=MAX_LEN, max_num_batched_tokens=512),
        speculative=SpeculativeConfig(method="mtp", model=draft, num_speculative_tokens=K, **spec),
    )


@pytest.fixture(scope="module")
def target_model(tiny_llama):
    return _target(tiny_llama)


@pytest.mark.parametrize("variant", ["standalone", "whole-target-shipped-head"])
def test_drafts_match_reference(variant, tiny_llama, target_model, tmp_path):
    whole = variant != "standalone"
    folder = write_mtp(str(tmp_path / "mtp"), tiny_llama, seed=1, ship_head=whole, whole_target=whole)
    ref = _Reference(folder, tiny_llama)
    config = _engine_config(tiny_llama, folder)
    spec = MTPProposer(config.speculative, config, torch.device("cpu"))
    assert spec.capture_layers == (FINAL_HIDDEN,)
    spec.load(target_model, 96 * BLOCK)
    assert (spec.model.head is target_model.lm_head) != whole

    def features(tokens):  # the runner's: the target's final-norm output
        return _final(target_model, tokens)

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 6, 9, MAX_LEN - 2)]
    tables = [[4 * j + i for j in range(MAX_LEN // BLOCK + 1)] for i in range(4)]  # interleaved: really paged
    # Round 1: sequences 0, 1 and 3 propose from their whole prompt; sequence 2 is a partial prefill chunk.
    propose = [True, True, False, True]
    feats = [features(t)[: len(t) - p] for t, p in zip(prompts, propose)]
    drafts = propose_drafts(spec, prompts, [0] * 4, tables, propose, [K, 2, 0, K], None, torch.cat(feats))
    assert drafts[2] == [] and len(drafts[1]) == 2
    assert len(drafts[3]) == 2  # drafts 3 and 4 would sit at positions >= max_model_len
    for i in (0, 1, 3):
        _, want = ref.run(prompts[i], K)
        assert drafts[i] == want[: len(drafts[i])], i
    assert len(set(drafts[0])) > 1

    # Round 2: sequence 0 accepted two drafts, sequence 1 none; each gets a new bonus token.
    accepted = {0: drafts[0][:2], 1: []}
    token_ids = [[prompts[i][-1]] + accepted[i] + [5 + i] for i in (0, 1)]
    starts = [len(prompts[i]) - 1 for i in (0, 1)]
    full = [prompts[i][:-1] + token_ids[i] for i in (0, 1)]
    feats = [features(f)[s : len(f) - 1] for f, s in zip(full, starts)]
    drafts = propose_drafts(spec, token_ids, starts, tables[:2], [True, True], [K, K], None, torch.cat(feats))
    for i in (0, 1):
        row_logits, want = ref.run(full[i], K)
        assert drafts[i] == want, i
        n = len(token_ids[i]) - 1
        with torch.inference_mode():
            normed, _ = spec._run(token_ids[i][1:], list(range(starts[i], starts[i] + n)), feats[i][:n], [n], [tables[i]])
            ours = spec.model.compute_logits(normed)
        expect = row_logits[starts[i] :].float()
        assert ((ours - expect).abs().max() / expect.abs().max()).item() < 1e-4


def _final(target, tokens: list[int]) -> torch.Tensor:
    """The target's final-norm output over a whole sequence [T, H], as the runner hands it over."""
    from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache

    n = len(tokens)
    caches = allocate_kv_cache(len(target.layers), n, target.kv_cache_shape, torch.float32)
    md = AttentionMetadata.build([n], [n], [list(range(n))], 1, torch.device("cpu"))
    with torch.inference_mode():
        hidden, _ = target(torch.tensor(tokens), torch.arange(n), caches, md, (FINAL_HIDDEN,))
    return hidden


def test_chain_steps_cycle_through_the_mtp_layers(tiny_llama, target_model, tmp_path):
    """Two MTP layers: step 0 (the refeed and draft 1) runs layer 0, chain step j layer j mod 2."""
    folder = write_mtp(str(tmp_path / "mtp2"), tiny_llama, seed=3, num_layers=2)
    config = _engine_config(tiny_llama, folder)
    spec = MTPProposer(config.speculative, config, torch.device("cpu"))
    spec.load(target_model, 96 * BLOCK)
    assert len(spec.kv_caches) == 2 and len(spec.model.layers) == 2
    calls = []
    layers = spec.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda mod, args, out, i=i: calls.append((i, args[1].shape[0])))
    tokens = list(range(10, 20))
    propose_drafts(spec, [tokens], [0], [list(range(16))], [True], [K], None, _final(target_model, tokens)[:-1])
    assert calls == [(0, 9), (1, 1), (0, 1), (1, 1)]


# ---- validation -------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(num_nextn_predict_layers=0), "num_nextn_predict_layers", "0"),
    (dict(num_nextn_predict_layers=None), "num_nextn_predict_layers", "None"),
    (dict(architectures=["Gemma3ForCausalLM"]), "architectures", "Gemma3ForCausalLM"),
    (dict(vocab_size=1024), "vocab_size", "1024"),
    (dict(hidden_size=64, head_dim=16), "hidden_size", "64"),
]


@pytest.mark.parametrize("overrides,field,value", BAD_CONFIGS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_CONFIGS)])
def test_bad_config(overrides, field, value, tiny_llama, tmp_path):
    folder = write_mtp(str(tmp_path / "mtp"), tiny_llama, **overrides)
    with pytest.raises(ValueError) as e:
        MTPConfig.from_folder(folder).validate(ModelArchConfig.from_folder(tiny_llama))
    assert field in str(e.value) and value in str(e.value)


@pytest.mark.parametrize("edit,name", [
    ("drop", "model.layers.3.eh_proj.weight"),
    ("drop", "model.layers.3.mlp.down_proj.weight"),
    ("shape", "model.layers.3.self_attn.k_proj.weight"),
    ("shape", "model.layers.3.enorm.weight"),
    ("extra", "model.layers.3.extra.weight"),
], ids=["missing-eh-proj", "missing-block", "k-proj-shape", "enorm-shape", "unknown"])
def test_bad_checkpoint(edit, name, tiny_llama, target_model, tmp_path):
    folder = write_mtp(str(tmp_path / "mtp"), tiny_llama)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    if edit == "drop":
        del tensors[name]
    elif edit == "shape":
        tensors[name] = tensors[name][:-1].contiguous()
    else:
        tensors[name] = torch.zeros(3)
    save_file(tensors, path)
    model = MTPModel(MTPConfig.from_folder(folder), target_model.config, target_model.embed_tokens, target_model.lm_head)
    with pytest.raises(ValueError) as e:
        model.load_weights(iterate_weights(folder, show_progress=False))
    short = name.removeprefix("model.layers.3.").removesuffix(".weight").split(".")[-1]
    assert short in str(e.value)
