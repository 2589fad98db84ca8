"""EAGLE-3 head (``method: eagle3``) on a tiny random checkpoint in the public key layout.

* The drafter's drafts (and the head's logits on every refed row) equal an independent reference:
  plain-torch EAGLE-3 written from the public description, fed Hugging Face ``hidden_states[j]``
  of the target at the configured aux ids (so tpspec's capture convention, j -> layer j - 1, is
  checked too). Two rounds: the second accepts some drafts and refeeds over the chained KV; a
  partial prefill chunk sits in the batch; a sequence near max_model_len gets fewer drafts.
  Checkpoint variants: embedding borrowed from the target / shipped, ``norm_before_residual``,
  the midlayer's keys named ``layers.0.`` instead of ``midlayer.``.
* ``get_top_tokens`` == ``compute_logits(...).argmax(-1)`` in target ids, ties included, at TP 1
  and 2 (midlayer split and replicated), moving 8·tp bytes per row instead of 4·padded draft vocab;
  compute_logits is -inf outside the draft vocabulary.
* Bad configs and checkpoints raise ValueError naming the field.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.distributed_utils import run_distributed
from tpspec.config import CacheConfig, EngineConfig, ModelArchConfig, SchedulerConfig, SpeculativeConfig
from tpspec.distributed import comm
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache
from tpspec.models.eagle3 import Eagle3Config, Eagle3LlamaForCausalLM
from tpspec.models.llama import LlamaForCausalLM
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.spec_decode.eagle import Eagle3Proposer
from tests.drafting_utils import propose_drafts

VOCAB, DRAFT_VOCAB = 1000, 500  # draft vocab padded to 512: padding on the last shard at TP 2
HEAD = dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
AUX_IDS = [2, 1, 2]  # HF hidden_states indices (the tiny target has 3 layers: 1 and 2 are valid)
K = 4
BLOCK = 4
MAX_LEN = 64


def write_eagle3(
    folder: str,
    seed: int = 0,
    ship_embedding: bool = False,
    norm_before_residual: bool = False,
    overrides: dict[str, torch.Tensor] | None = None,
    midlayer_prefix: str = "midlayer.",
    **config,
) -> str:
    """A random EAGLE-3 checkpoint for the tiny Llama target (tests/conftest.py): public key
    layout and config fields (``config`` overrides them), draft vocab 500 of the target's 1000
    with a sorted random d2t; ``overrides`` replaces or adds tensors (named with ``midlayer.``)."""
    cfg = dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1, vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, hidden_act="silu", eagle_aux_hidden_state_layer_ids=AUX_IDS,
        norm_before_residual=norm_before_residual, **HEAD,
    )
    cfg.update(config)
    g = torch.Generator().manual_seed(seed)
    h, inter, draft_vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"]
    d = h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def mat(rows, cols, std=0.15):
        return torch.randn(rows, cols, generator=g) * std

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    target_ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": mat(h, len(AUX_IDS) * h, 0.1),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(q_out, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv_out, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv_out, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, q_out),
        "midlayer.mlp.gate_proj.weight": mat(inter, h),
        "midlayer.mlp.up_proj.weight": mat(inter, h),
        "midlayer.mlp.down_proj.weight": mat(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": mat(draft_vocab, h, 0.3),
        "d2t": target_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if ship_embedding:
        tensors["embed_tokens.weight"] = mat(VOCAB, h, 1.0)
    tensors.update(overrides or {})
    os.makedirs(folder, exist_ok=True)
    tensors = {k.replace("midlayer.", midlayer_prefix): v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


# ---- reference: plain torch, from the public description ------------------------------------------


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x: [T, heads, d], rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


class _Reference:
    """EAGLE-3 in float64 over whole sequences (no cache): row t = (features at t, token t + 1)."""

    def __init__(self, folder: str, target_folder: str):
        import transformers
        from safetensors.torch import load_file

        self.w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = json.load(f)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(target_folder, torch_dtype=torch.float64).eval()
        self.embed = self.w.get("embed_tokens.weight", self.hf.model.embed_tokens.weight.detach())

    def features(self, tokens: list[int]) -> torch.Tensor:  # [T, 3H] from HF hidden_states[j]
        with torch.no_grad():
            hs = self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([hs[j][0] for j in self.cfg["eagle_aux_hidden_state_layer_ids"]], -1)

    def layer(self, embeds, hidden, pos):
        w, c = self.w, self.cfg
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        hn = _rms(hidden, w["midlayer.hidden_norm.weight"])
        residual = hn if c["norm_before_residual"] else hidden
        x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"]), hn], -1)
        q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, d), pos)
        k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, d), pos)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        causal = torch.ones(len(pos), len(pos), dtype=torch.bool).tril()
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).reshape(len(pos), -1)
        h = attn @ w["midlayer.self_attn.o_proj.weight"].T + residual
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
        out = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T + h
        return _rms(out, w["norm.weight"]), out

    def logits(self, normed):  # [rows, VOCAB], -inf outside the draft vocab
        full = torch.full((normed.shape[0], VOCAB), float("-inf"), dtype=torch.float64)
        full[:, torch.arange(DRAFT_VOCAB) + self.w["d2t"]] = normed @ self.w["lm_head.weight"].T
        return full

    def run(self, tokens: list[int], k: int) -> tuple[torch.Tensor, list[int]]:
        """Logits of rows 0 … n − 1 of ``tokens`` (x_0 … x_n) and the k greedy chain drafts."""
        n = len(tokens) - 1
        hidden = self.features(tokens)[:n] @ self.w["fc.weight"].T
        embeds = self.embed[torch.tensor(tokens[1:])]
        pos = torch.arange(n)
        normed, prenorm = self.layer(embeds, hidden, pos)
        row_logits, drafts = self.logits(normed), []
        for _ in range(k):
            drafts.append(int(self.logits(normed[-1:]).argmax(-1)))
            hidden = torch.cat([hidden, prenorm[-1:]])
            embeds = torch.cat([embeds, self.embed[drafts[-1]][None]])
            pos = torch.arange(len(pos) + 1)
            normed, prenorm = self.layer(embeds, hidden, pos)
        return row_logits, drafts


# ---- tpspec side ------------------------------------------------------------------------------------


def _engine_config(target: str, draft: str, **spec) -> EngineConfig:
    return EngineConfig(
        model=target, arch=ModelArchConfig.from_folder(target),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=96, kv_cache_dtype="float32"),  # against a float32 reference
        scheduler=SchedulerConfig(max_model_len=MAX_LEN, max_num_batched_tokens=512),
        speculative=SpeculativeConfig(method="eagle3", model=draft, num_speculative_tokens=K, **spec),
    )


def _target(folder: str) -> LlamaForCausalLM:
    arch = ModelArchConfig.from_folder(folder)
    model = LlamaForCausalLM(arch)
    model.load_weights(iterate_weights(folder, show_progress=False))
    return model.eval()


def _captured(target: LlamaForCausalLM, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """tpspec's target features of a whole sequence, as the runner concatenates them [T, n·H]."""
    n = len(tokens)
    caches = allocate_kv_cache(len(target.layers), n, target.kv_cache_shape, torch.float32)
    md = AttentionMetadata.build([n], [n], [list(range(n))], 1, torch.device("cpu"))
    with torch.inference_mode():
        _, captured = target(torch.tensor(tokens), torch.arange(n), caches, md, layers)
    return torch.cat([captured[layer] for layer in layers], -1)


@pytest.fixture(scope="module")
def target_model(tiny_llama) -> LlamaForCausalLM:
    return _target(tiny_llama)


@pytest.mark.parametrize("variant", ["borrowed-embedding", "shipped-embedding-norm-first-layers0"])
def test_drafts_match_reference(variant, tiny_llama, target_model, tmp_path):
    shipped = variant != "borrowed-embedding"
    folder = str(tmp_path / "eagle")
    ref = _Reference(write_eagle3(folder, seed=1, ship_embedding=shipped, norm_before_residual=shipped), tiny_llama)
    if shipped:  # the same tensors, the midlayer's keys named layers.0. (the reference read them above)
        write_eagle3(folder, seed=1, ship_embedding=True, norm_before_residual=True, midlayer_prefix="layers.0.")
    config = _engine_config(tiny_llama, folder)
    spec = Eagle3Proposer(config.speculative, config, torch.device("cpu"))
    assert spec.capture_layers == (1, 0, 1)  # ids 2, 1, 2 = outputs of layers 1, 0, 1
    spec.load(target_model, 96 * BLOCK)
    assert (spec.model.embedding is target_model.embed_tokens) != shipped

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 6, 9, MAX_LEN - 2)]
    tables = [[4 * j + i for j in range(MAX_LEN // BLOCK + 1)] for i in range(4)]  # interleaved: really paged
    # Round 1: sequences 0, 1 and 3 propose from their whole prompt (its last token plays the bonus
    # token); sequence 2 is a partial prefill chunk (feed only) between them.
    token_ids = prompts
    propose = [True, True, False, True]
    feats = [_captured(target_model, t, spec.capture_layers)[: len(t) - p] for t, p in zip(token_ids, propose)]
    # Sequence 1 wants only 2 drafts (the speculation length varies per request).
    drafts = propose_drafts(spec, token_ids, [0] * 4, tables, propose, [K, 2, 0, K], None, torch.cat(feats))
    assert drafts[2] == [] and all(q is None for q in spec.states.values() for q in [q.draft_dists])
    assert len(drafts[1]) == 2
    assert len(drafts[3]) == 2  # drafts 3 and 4 would sit at positions >= max_model_len
    for i in (0, 1, 3):
        _, want = ref.run(prompts[i], K)
        assert drafts[i] == want[: len(drafts[i])], i

    # Round 2: sequence 0 accepted two drafts, sequence 1 none; each gets a new bonus token.
    accepted = {0: drafts[0][:2], 1: []}
    token_ids = [[prompts[i][-1]] + accepted[i] + [5 + i] for i in (0, 1)]
    starts = [len(prompts[i]) - 1 for i in (0, 1)]
    full = [prompts[i][:-1] + token_ids[i] for i in (0, 1)]
    feats = [_captured(target_model, f, spec.capture_layers)[s : len(f) - 1] for f, s in zip(full, starts)]
    drafts = propose_drafts(spec, token_ids, starts, tables[:2], [True, True], [K, K], None, torch.cat(feats))
    for i in (0, 1):
        row_logits, want = ref.run(full[i], K)
        assert drafts[i] == want, i
        # The refed rows' logits, through the same cache (rows before start_pos were written in round 1).
        n = len(token_ids[i]) - 1
        hidden = spec.model.combine_hidden_states(feats[i][:n])
        with torch.inference_mode():
            normed, _ = spec._run(token_ids[i][1:], list(range(starts[i], starts[i] + n)), hidden, [n], [tables[i]])
            ours = spec.model.compute_logits(normed)
        expect = row_logits[starts[i] :].float()
        finite = torch.isfinite(expect)
        assert torch.equal(finite, torch.isfinite(ours))
        assert ((ours[finite] - expect[finite]).abs().max() / expect[finite].abs().max()).item() < 1e-4


# ---- get_top_tokens ---------------------------------------------------------------------------------


def _top_tokens_check(folder: str, target_folder: str) -> list[dict]:
    """On every rank, midlayer split and replicated: the head (its own embedding) over
    tie-planting rows and random rows."""
    results = []
    for replicated in (False, True):
        cfg = Eagle3Config.from_folder(folder)
        model = Eagle3LlamaForCausalLM(cfg, ModelArchConfig.from_folder(target_folder), None, torch.float32, replicated)
        model.load_weights(iterate_weights(folder, show_progress=False))
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(40, cfg.arch.hidden_size, generator=g)
        # Ties across shards: draft rows 10 and 300 (shards 0 and 1 at TP 2) made equal and winning.
        w = model.lm_head.weight
        for draft_id in (10, 300):
            if model.lm_head.vocab_start <= draft_id < model.lm_head.vocab_end:
                w[draft_id - model.lm_head.vocab_start] = 5 * hidden[0] / hidden[0].norm()
        hidden[:8] = hidden[0]
        comm.reset_comm_stats()
        with torch.inference_mode():
            logits = model.compute_logits(hidden, site="full")
            top = model.get_top_tokens(hidden, site="top")
            greedy = model.greedy_tokens(hidden, site="greedy")
        outside = ~torch.isin(torch.arange(VOCAB), model.target_ids)
        results.append(dict(full=logits.argmax(-1).tolist(), top=top.tolist(), greedy=greedy.tolist(), stats=comm.get_comm_stats(),
                            inf_outside=bool(torch.isinf(logits[:, outside]).all()), tie_ids=model.target_ids[[10, 300]].tolist()))
    return results


def test_held_rows_do_not_keep_the_steps_features_alive(tiny_llama, target_model, tmp_path):
    """A request held at k = 0 keeps its rows' target features as its own copies (not views of the
    step's features, which a prefill chunk can make large), and a drop keeps only the newest rows'."""
    config = _engine_config(tiny_llama, write_eagle3(str(tmp_path / "eagle"), seed=1))
    spec = Eagle3Proposer(config.speculative, config, torch.device("cpu"))
    spec.load(target_model, 96 * BLOCK)
    spec.max_deferred_tokens = 6  # drops down to 3 rows
    width = spec.feature_width
    tables = [[4 * j + i for j in range(MAX_LEN // BLOCK + 1)] for i in range(3)]
    row_bytes = width * 4
    for step in range(7):  # three requests held, one new row each (their bonus token ends each step)
        features = torch.randn(3, width)
        propose_drafts(spec, [[5, 6]] * 3, [10 + step] * 3, tables, [True] * 3, [0] * 3, None, features)
        for i in range(3):
            deferred = spec.states[f"seq-{i}"].deferred
            kept = sum(f.shape[0] for f in deferred.features)
            assert kept == len(deferred.positions) == (step + 1 if step < 6 else 3)
            storages = {f.untyped_storage().data_ptr(): f.untyped_storage().nbytes() for f in deferred.features}
            assert features.untyped_storage().data_ptr() not in storages
            assert sum(storages.values()) <= 3 * kept * row_bytes  # at most the held rows of each step kept
            if step == 6:  # dropped: one copy of the newest rows alone
                assert list(storages.values()) == [3 * row_bytes]
                assert torch.equal(deferred.features[0][-1], features[i])


@pytest.mark.parametrize("tp", [1, 2])
def test_get_top_tokens_and_greedy_tokens_equal_compute_logits_argmax(tp, tiny_llama, tmp_path):
    folder = write_eagle3(str(tmp_path / "eagle"), seed=2, ship_embedding=True)
    per_rank = [_top_tokens_check(folder, tiny_llama)] if tp == 1 else run_distributed(_top_tokens_check, tp, folder, tiny_llama)
    ref = per_rank[0][0]
    for r in (r for rank in per_rank for r in rank):
        assert r["top"] == r["full"] == r["greedy"] == ref["top"]
        assert r["top"][:8] == [r["tie_ids"][0]] * 8  # the tie goes to the lower id
        assert r["inf_outside"]
        if tp == 1:
            assert r["stats"] == {}
        else:  # padded draft vocab 512
            gathered = {"calls": 1, "bytes": 4 * 512 * 40, "cross_node_bytes": 0}  # the draft vocabulary, whole
            assert r["stats"] == {"full": gathered, "greedy": gathered,
                                  "top": {"calls": 1, "bytes": 8 * tp * 40, "cross_node_bytes": 0}}
    assert len(set(ref["top"])) > 10


# ---- validation -------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(architectures=["LlamaForCausalLM"]), "architectures", "LlamaForCausalLM"),
    (dict(num_hidden_layers=2), "num_hidden_layers", "2"),
    (dict(draft_vocab_size=1001), "draft_vocab_size", "1001"),
    (dict(draft_vocab_size="500"), "draft_vocab_size", "'500'"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 3, 2]), "eagle_aux_hidden_state_layer_ids", "[1, 3, 2]"),
    (dict(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "eagle_aux_hidden_state_layer_ids", "[0, 1, 2]"),
    (dict(eagle_aux_hidden_state_layer_ids=None), "eagle_aux_hidden_state_layer_ids", "default"),
    (dict(eagle_aux_hidden_state_layer_ids="2"), "eagle_aux_hidden_state_layer_ids", "'2'"),
    (dict(norm_before_residual="no"), "norm_before_residual", "'no'"),
    (dict(vocab_size=1024), "vocab_size", "1024"),
    (dict(target_hidden_size=64), "target_hidden_size", "64"),
]


@pytest.mark.parametrize("overrides,field,value", BAD_CONFIGS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_CONFIGS)])
def test_bad_config(overrides, field, value, target_model, tmp_path):
    folder = write_eagle3(str(tmp_path / "eagle"))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(cfg, **overrides), f)
    with pytest.raises(ValueError) as e:
        cfg = Eagle3Config.from_folder(folder)
        Eagle3LlamaForCausalLM(cfg, target_model.config, target_model.embed_tokens)
    assert field in str(e.value) and value in str(e.value)


def test_default_aux_layers():
    cfg = Eagle3Config(ModelArchConfig.from_hf_config(dict(HEAD, vocab_size=VOCAB, num_hidden_layers=1)), DRAFT_VOCAB, 96, None, False)
    assert cfg.fc_layers(32) == (1, 15, 28)  # inputs of layers 2, 16, 29 = outputs of 1, 15, 28
    with pytest.raises(ValueError, match=r"default \(2, N//2, N-3\) for N=3"):
        cfg.fc_layers(3)


def _drop(name):
    def edit(tensors):
        del tensors[name]
    return edit


def _set(name, value):
    def edit(tensors):
        tensors[name] = value(tensors[name])
    return edit


BAD_CHECKPOINTS = [
    ("d2t-decreasing", _set("d2t", lambda d: d.flip(0)), "d2t"),
    ("d2t-out-of-range", _set("d2t", lambda d: d + 600), "d2t"),
    ("d2t-missing", _drop("d2t"), "d2t"),
    ("fc-shape", _set("fc.weight", lambda w: w[:, :192].contiguous()), "fc.weight"),
    ("lm-head-shape", _set("lm_head.weight", lambda w: w[:400].contiguous()), "lm_head.weight"),
    ("lm-head-missing", _drop("lm_head.weight"), "lm_head.weight"),
    ("unknown", _set("norm.weight", lambda w: w), "extra.weight"),
]


@pytest.mark.parametrize("edit,name", [b[1:] for b in BAD_CHECKPOINTS], ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoint(edit, name, target_model, tmp_path):
    from safetensors.torch import load_file

    folder = write_eagle3(str(tmp_path / "eagle"))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    if name == "extra.weight":
        tensors[name] = torch.zeros(3)
    save_file(tensors, path)
    model = Eagle3LlamaForCausalLM(Eagle3Config.from_folder(folder), target_model.config, target_model.embed_tokens)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        model.load_weights(iterate_weights(folder, show_progress=False))
