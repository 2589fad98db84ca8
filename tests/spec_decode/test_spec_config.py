"""``--speculative-config`` validation: every user error is a ValueError that names the key and
the bad value, raised by ``SpeculativeConfig.from_dict``, by ``LLM(...)`` before any model is
loaded (engine-level checks: draft TP size, draft vocabulary, draft context), or, for
``use_local_argmax_reduction``, against the draft model's class, still in the caller's process
(vLLM's MR V2 checks it at model load, in the workers)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from tpspec import LLM, SamplingParams
from tpspec.config import EngineConfig, ModelArchConfig, SchedulerConfig, SpeculativeConfig
from tpspec.spec_decode.speculator import check_local_argmax_reduction

DRAFT = {"method": "draft_model", "model": "/some/draft", "num_speculative_tokens": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _with(base: dict, **kw) -> dict:
    d = dict(base, **kw)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()

# (id, config, the key the message must name, the bad value as it must appear)
BAD = [
    ("unknown-key", _with(DRAFT, num_spec_tokens=4), "num_spec_tokens", None),
    ("unknown-key-ngram", _with(NGRAM, lookahead=2), "lookahead", None),
    ("k-str", _with(DRAFT, num_speculative_tokens="3"), "num_speculative_tokens", "'3'"),
    ("k-float", _with(NGRAM, num_speculative_tokens=3.0), "num_speculative_tokens", "3.0"),
    ("k-bool", _with(NGRAM, num_speculative_tokens=True), "num_speculative_tokens", "True"),
    ("k-zero", _with(DRAFT, num_speculative_tokens=0), "num_speculative_tokens", "0"),
    ("k-negative", _with(NGRAM, num_speculative_tokens=-2), "num_speculative_tokens", "-2"),
    ("k-huge", _with(DRAFT, num_speculative_tokens=65), "num_speculative_tokens", "65"),
    ("k-missing", _with(NGRAM, num_speculative_tokens=_DROP), "num_speculative_tokens", "required"),
    ("method-missing", _with(DRAFT, method=_DROP), "method", "required"),
    ("flag-str", _with(DRAFT, use_local_argmax_reduction="yes"), "use_local_argmax_reduction", "'yes'"),
    ("flag-int", _with(DRAFT, use_local_argmax_reduction=1), "use_local_argmax_reduction", "1"),
    ("bad-method", _with(DRAFT, method="medusa"), "method", "'medusa'"),
    ("method-case", _with(NGRAM, method="NGRAM"), "method", "'NGRAM'"),
    ("method-list", _with(NGRAM, method=["ngram"]), "method", "['ngram']"),
    ("flag-with-ngram", _with(NGRAM, use_local_argmax_reduction=True), "use_local_argmax_reduction", "true"),
    ("model-with-ngram", _with(NGRAM, model="/some/draft"), "model", "'/some/draft'"),
    ("draft-tp-with-ngram", _with(NGRAM, draft_tensor_parallel_size=1), "draft_tensor_parallel_size", "1"),
    ("probabilistic-ngram", _with(NGRAM, draft_sample_method="probabilistic"), "draft_sample_method",
     "'probabilistic'"),
    ("draft-without-model", _with(DRAFT, model=_DROP), "model", "None"),
    ("model-not-str", _with(DRAFT, model=3), "model", "3"),
    ("sample-method", _with(DRAFT, draft_sample_method="top_k"), "draft_sample_method", "'top_k'"),
    ("draft-tp-zero", _with(DRAFT, draft_tensor_parallel_size=0), "draft_tensor_parallel_size", "0"),
    ("draft-tp-str", _with(DRAFT, draft_tensor_parallel_size="2"), "draft_tensor_parallel_size", "'2'"),
    ("lookup-min-zero", _with(NGRAM, prompt_lookup_min=0), "prompt_lookup_min", "0"),
    ("lookup-max-str", _with(NGRAM, prompt_lookup_max="4"), "prompt_lookup_max", "'4'"),
    ("lookup-min-gt-max", _with(NGRAM, prompt_lookup_min=5, prompt_lookup_max=3), "prompt_lookup_min", "5"),
    ("lookup-with-draft", _with(DRAFT, prompt_lookup_min=2), "prompt_lookup_min", "2"),
    ("prior-one", _with(DRAFT, acceptance_prior=[0.5, 1.0]), "acceptance_prior", "1.0"),
    ("prior-empty", _with(DRAFT, acceptance_prior=[]), "acceptance_prior", "[]"),
    ("prior-number", _with(DRAFT, acceptance_prior=0.5), "acceptance_prior", "0.5"),
]


@pytest.mark.parametrize("config,key,value", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_from_dict_rejects(config, key, value):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_dict(config)
    msg = str(info.value)
    assert key in msg, msg
    if value is not None:
        assert value in msg, msg
    # The JSON form (what --speculative-config takes) fails the same way, unless a value has no JSON form.
    with pytest.raises(ValueError, match=re.escape(key)):
        SpeculativeConfig.from_dict(json.dumps(config))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "3"])
def test_from_dict_rejects_non_objects(text):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(text)


def test_from_dict_accepts_and_fills_defaults():
    c = SpeculativeConfig.from_dict(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 2, 4)
    assert c.model is None and c.use_local_argmax_reduction is False and c.draft_sample_method == "greedy"
    c = SpeculativeConfig.from_dict(_with(DRAFT, use_local_argmax_reduction=True, draft_tensor_parallel_size=1))
    assert c.use_local_argmax_reduction is True and c.draft_tensor_parallel_size == 1
    # The flag with probabilistic drafting is checked against the draft model's class (it needs
    # compute_logits_shard) when the drafter is resolved, not here.
    SpeculativeConfig.from_dict(_with(DRAFT, use_local_argmax_reduction=True, draft_sample_method="probabilistic"))


def test_llm_validates_speculative_config_before_loading(tiny_llama):
    """LLM(...) turns a dict or a JSON string into a SpeculativeConfig with the same checks."""
    with pytest.raises(ValueError, match=r"num_speculative_tokens.*'3'"):
        LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": "3"})
    with pytest.raises(ValueError, match=r"use_local_argmax_reduction.*'yes'"):
        LLM(tiny_llama, speculative_config=json.dumps(_with(DRAFT, model=tiny_llama, use_local_argmax_reduction="yes")))
    with pytest.raises(ValueError, match=r"unknown keys \['speculative_model'\]"):
        LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"})


def test_a_drafter_without_a_model_needs_a_target_tpspec_ships_one_for(tiny_llama):
    """Only the default model and the packaged Gemma 3 have shipped DFlash drafters, only the
    default model an EAGLE-3 head; any other target must name one, and the message says which
    targets do not need to. Methods without shipped drafters always need one."""
    with pytest.raises(ValueError, match=r"speculative_config.model is required .*the default model or --model gemma-3-270m$"):
        LLM(tiny_llama, speculative_config={"method": "dflash", "num_speculative_tokens": 3})
    for method in ("eagle3", "eagle"):
        with pytest.raises(ValueError, match=rf"required for method '{method}' .*drafter for: the default model$"):
            LLM(tiny_llama, speculative_config={"method": method, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config.model is required for method 'draft_model'"):
        LLM(tiny_llama, speculative_config={"method": "draft_model", "num_speculative_tokens": 3})


def test_the_most_drafts_default_to_what_the_drafter_was_trained_for(tiny_llama):
    """tpspec chooses k itself, so the maximum may be left out: the shipped EAGLE-3 head's chain
    depth (the methods table), a DFlash drafter's block size − 1 (its checkpoint); a draft model
    says nothing, so there it stays required. Resolved before any worker starts."""
    from tpspec.engine.engine_args import EngineArgs

    def resolved(spec, model=None):
        return EngineArgs(model=model, speculative_config=spec).create_engine_config("cpu").speculative

    def k(spec, model=None):
        return resolved(spec, model).num_speculative_tokens

    assert SpeculativeConfig.from_dict({"method": "eagle3"}).num_speculative_tokens == 6
    assert k({"method": "eagle3"}) == 6 and k({"method": "eagle"}) == 6
    # The alias is the same row: the same shipped head, the same speculator.
    eagle, eagle3 = resolved({"method": "eagle"}), resolved({"method": "eagle3"})
    assert eagle.model == eagle3.model and eagle.model.endswith("smollm2-135m-eagle3")
    assert eagle.method_spec is eagle3.method_spec
    assert k({"method": "dflash"}) == 15
    assert k({"method": "dflash", "num_speculative_tokens": 4}) == 4
    with pytest.raises(ValueError, match=r"num_speculative_tokens is required for method 'draft_model'"):
        k({"method": "draft_model", "model": tiny_llama}, tiny_llama)


def test_the_acceptance_prior_defaults_to_what_the_drafter_measured(tiny_llama, tmp_path):
    """The shipped drafters' folders record their held-out greedy acceptance per position
    (``acceptance.json``); the resolution hands it to the controller unless the config gives one;
    a drafter that records none leaves it to the controller's default."""
    import json
    import shutil

    from tpspec.engine.engine_args import EngineArgs

    def prior(spec, model=None):
        return EngineArgs(model=model, speculative_config=spec).create_engine_config("cpu").speculative.acceptance_prior

    eagle = prior({"method": "eagle3"})
    assert len(eagle) == 6 and 0.45 < eagle[0] < 0.6  # the shipped head's measured rates
    dflash = prior({"method": "dflash"})
    assert len(dflash) == 3 and dflash[0] > dflash[1] > dflash[2]  # the shipped DFlash drafter's
    assert prior({"method": "eagle3", "acceptance_prior": [0.7]}) == (0.7,)
    assert prior({"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}, tiny_llama) is None
    folder = shutil.copytree(tiny_llama, tmp_path / "draft")
    with open(folder / "acceptance.json", "w") as f:
        json.dump({"greedy_acceptance_rates": [0.8, 0.6]}, f)
    assert prior({"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}, tiny_llama) == (0.8, 0.6)


@pytest.mark.parametrize("tp,draft_tp", [(1, 2), (2, 3), (2, 4)])
def test_draft_tensor_parallel_size_must_be_1_or_the_targets(tiny_llama, tp, draft_tp):
    # Raised by EngineConfig, before any worker is spawned.
    spec = _with(DRAFT, model=tiny_llama, draft_tensor_parallel_size=draft_tp)
    msg = rf"draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size \({tp}\), got {draft_tp}"
    with pytest.raises(ValueError, match=msg):
        LLM(tiny_llama, tensor_parallel_size=tp, speculative_config=spec)


def _copy_with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    # 1024 is the target's *padded* vocabulary (1000 -> 1024): the check compares real vocabularies.
    for vocab in (1024, 999):
        draft = _copy_with_config(tiny_llama, str(tmp_path / f"draft-{vocab}"), vocab_size=vocab)
        with pytest.raises(ValueError, match=rf"vocab_size \({vocab}\) differs from the target's \(1000\)"):
            LLM(tiny_llama, speculative_config=_with(DRAFT, model=draft))


def test_draft_with_a_shorter_context_is_refused(tiny_llama, tmp_path):
    draft = _copy_with_config(tiny_llama, str(tmp_path / "draft-short"), max_position_embeddings=128)
    msg = r"max_model_len \(512\) exceeds the draft model's max_position_embeddings \(128\)"
    with pytest.raises(ValueError, match=msg):
        LLM(tiny_llama, speculative_config=_with(DRAFT, model=draft))
    with LLM(tiny_llama, max_model_len=128, num_kv_blocks=16, speculative_config=_with(DRAFT, model=draft)) as llm:
        assert llm.llm_engine.config.speculative.model == draft  # within the draft's context: accepted


def test_flag_with_probabilistic_drafting_loads_a_model_with_sharded_logits(tiny_llama):
    """Llama drafts provide compute_logits_shard: probabilistic drafting with the flag is vocab-parallel
    (tests/distributed/test_sharding_invariance.py runs it at TP 1, 2 and 4)."""
    spec = _with(DRAFT, model=tiny_llama, use_local_argmax_reduction=True, draft_sample_method="probabilistic")
    with LLM(tiny_llama, num_kv_blocks=16, max_model_len=64, speculative_config=spec) as llm:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
        assert len(llm.generate("def add(a, b):", params, use_tqdm=False)[0].outputs[0].token_ids) == 6


# ---- check_local_argmax_reduction on stub model classes (before any worker starts) ---------------


class _NoTopTokens(torch.nn.Module):
    def compute_logits(self, hidden, site="draft.sample"):
        raise AssertionError("not called")


class _TopTokensNotCallable(_NoTopTokens):
    get_top_tokens = None


class _WithTopTokens(_NoTopTokens):
    def get_top_tokens(self, hidden, site="draft.sample"):
        raise AssertionError("not called")


def _check(tiny_llama, model_cls, **spec) -> None:
    check_local_argmax_reduction(SpeculativeConfig.from_dict(_with(DRAFT, model=tiny_llama, **spec)), model_cls)


@pytest.mark.parametrize("model_cls", [_NoTopTokens, _TopTokensNotCallable])
def test_flag_needs_a_draft_model_with_get_top_tokens(tiny_llama, model_cls):
    msg = rf"use_local_argmax_reduction=true needs a draft model with get_top_tokens\(\); {model_cls.__name__} has none"
    with pytest.raises(ValueError, match=msg):
        _check(tiny_llama, model_cls, use_local_argmax_reduction=True)
    # Without the flag the same model is fine (drafting all-gathers full logits instead).
    _check(tiny_llama, model_cls)


class _WithShardedLogits(_WithTopTokens):
    def compute_logits_shard(self, hidden):
        raise AssertionError("not called")


def test_flag_accepts_a_draft_model_with_get_top_tokens(tiny_llama):
    _check(tiny_llama, _WithTopTokens, use_local_argmax_reduction=True)
    # Probabilistic drafting with the flag needs the sharded hook; without it the old error stays.
    msg = r"use_local_argmax_reduction=true only applies to greedy.*'probabilistic'.*compute_logits_shard"
    with pytest.raises(ValueError, match=msg):
        _check(tiny_llama, _WithTopTokens, use_local_argmax_reduction=True, draft_sample_method="probabilistic")
    _check(tiny_llama, _WithShardedLogits, use_local_argmax_reduction=True, draft_sample_method="probabilistic")


def test_kv_lookahead_only_for_a_draft_model(tiny_llama):
    """A draft model writes KV for the bonus token and k - 1 drafts past the verified tokens; ngram
    proposes on the driver and needs no reserved slots."""
    arch = ModelArchConfig.from_folder(tiny_llama)

    def engine(spec):
        return EngineConfig(
            model=tiny_llama, arch=arch, scheduler=SchedulerConfig(max_model_len=512),
            speculative=SpeculativeConfig.from_dict(spec), draft_arch=arch if "model" in spec else None,
        )

    assert engine(_with(DRAFT, model=tiny_llama, num_speculative_tokens=5)).num_lookahead_tokens == 5
    assert engine(_with(NGRAM, num_speculative_tokens=5)).num_lookahead_tokens == 0
    plain = EngineConfig(model=tiny_llama, arch=arch, scheduler=SchedulerConfig(max_model_len=512))
    assert plain.num_lookahead_tokens == 0
