"""Speculative decoding end to end through ``LLM``, on tiny random checkpoints.

* Greedy losslessness: speculative output == plain output token for token, for ngram and
  draft_model (self-draft: 100% acceptance; a perturbed copy and a Qwen3 draft: partial
  acceptance, so rejections and KV rollback happen), TP 1 and 2, the flag on and off, a replicated
  draft (draft_tensor_parallel_size 1) under TP 2; prompts of different lengths in one batch, with
  stop tokens / stop strings / max_tokens ending inside an accepted run and sampled requests mixed in.
* With use_local_argmax_reduction drafting never materializes full logits: at TP 1 the draft
  model's compute_logits may raise; at TP 2 draft.sample moves 8·tp bytes per draft row instead of
  4·padded_vocab.
* Probabilistic drafting: runs at TP 1 and 2, seeded requests give the same tokens at both, greedy
  requests stay lossless, and a self-draft accepts (almost) every sampled draft (q = p).
* Nothing leaks: KV blocks and the runner's per-request draft distributions are freed whatever way
  requests end (finished, stopped, aborted running or waiting, preempted), with a KV cache of
  exactly max_model_len tokens.
* Spec-decode counters are consistent with each other and with the tokens generated.

Engines are created, used and shut down inside memoized run functions (one TP group per process).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpspec import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import",
    "Tensor parallelism splits the vocabulary across ranks, and",
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # a repeated pattern: ngram proposes (wrong) drafts at once
]
MAX_TOKENS = 24
REF_TOKENS = 64
K = 4
ENGINE = dict(num_kv_blocks=128, block_size=8, max_model_len=128)
SMALL = dict(num_kv_blocks=16, block_size=4, max_model_len=64)  # 64 tokens: exactly max_model_len
PADDED_VOCAB = 1024  # the tiny models' vocab 1000, padded to a multiple of 64

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.8, seed=101, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.5, seed=102, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=103, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.2, seed=104, min_p=0.05, max_tokens=MAX_TOKENS, ignore_eos=True),
]


# ---- checkpoints ----------------------------------------------------------------------------------


def _derived_checkpoint(src: str, dst: str, transform) -> str:
    """A copy of ``src`` with every weight passed through ``transform(name, tensor)``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: transform(k, v).contiguous() for k, v in weights.items()}, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    gen = torch.Generator().manual_seed(1234)

    def perturb(name, w):  # 2% noise on every matrix: the draft agrees with the target ~40% of the time
        return w + 0.02 * w.std() * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w

    def near_bigram(name, w):  # attention/MLP outputs scaled down: greedy output falls into loops
        return w * 0.02 if name.endswith(("o_proj.weight", "down_proj.weight")) else w

    root = tmp_path_factory.mktemp("spec-models")
    return {
        "dflash": _trained_dflash(tiny_llama, str(root / "dflash-work"), str(root / "dflash")),
        "llama": tiny_llama,
        "qwen3": tiny_qwen3,
        "perturbed": _derived_checkpoint(tiny_llama, str(root / "perturbed"), perturb),
        "loopy": _derived_checkpoint(tiny_llama, str(root / "loopy"), near_bigram),
    }


def _trained_dflash(target: str, work: str, out: str) -> str:
    """A 1-layer DFlash drafter trained (by tpspec's own trainer) on the target's greedy
    continuations of PROMPTS, just long enough to accept drafts often but not always."""
    from tpspec.train.recipe import DraftRecipe, TrainConfig
    from tpspec.train.train_draft import train_draft

    recipe = DraftRecipe(num_layers=1, target_layer_ids=(0, 2), block_size=6, max_tokens=REF_TOKENS,
                         generation_dtype="float32", max_num_seqs=8, text_tokens=0)
    train = TrainConfig(steps=60, seqs_per_step=4, anchors_per_seq=16, lr=3e-3, warmup_steps=10,
                        checkpoint_every=60, eval_every=60)
    train_draft(work, out, target, recipe, train, prompts=PROMPTS, held_out_prompts=PROMPTS[:1])
    return out


# k is pinned (adaptive: false) here: the accounting below counts fixed-k rounds, and flag on/off
# runs must draft the same rows. tests/spec_decode/test_speculation_length.py varies k.
def _dflash(flag: bool, **kw) -> dict:
    return dict(method="dflash", model="dflash", num_speculative_tokens=K, use_local_argmax_reduction=flag,
                adaptive=False, **kw)


def _draft(model: str, flag: bool, **kw) -> dict:
    return dict(method="draft_model", model=model, num_speculative_tokens=K, use_local_argmax_reduction=flag,
                adaptive=False, **kw)


NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)

# name: (target, tp, speculative config with the draft named by its key in ``models``)
CASES = {
    "ngram-tp1": ("loopy", 1, NGRAM),
    "ngram-tp2": ("loopy", 2, NGRAM),
    "self-flag-tp1": ("llama", 1, _draft("llama", True)),
    "self-noflag-tp1": ("llama", 1, _draft("llama", False)),
    "perturbed-flag-tp1": ("llama", 1, _draft("perturbed", True)),
    "perturbed-noflag-tp1": ("llama", 1, _draft("perturbed", False)),
    "qwen3-flag-tp1": ("llama", 1, _draft("qwen3", True)),
    "self-flag-tp2": ("llama", 2, _draft("llama", True)),
    "self-noflag-tp2": ("llama", 2, _draft("llama", False)),
    "perturbed-flag-tp2": ("llama", 2, _draft("perturbed", True)),
    "perturbed-noflag-tp2": ("llama", 2, _draft("perturbed", False)),
    "perturbed-drafttp1-flag-tp2": ("llama", 2, _draft("perturbed", True, draft_tensor_parallel_size=1)),
    "dflash-flag-tp1": ("llama", 1, _dflash(True)),
    "dflash-noflag-tp1": ("llama", 1, _dflash(False)),
    "dflash-flag-tp2": ("llama", 2, _dflash(True)),
    "dflash-noflag-tp2": ("llama", 2, _dflash(False)),
    "dflash-drafttp1-flag-tp2": ("llama", 2, _dflash(True, draft_tensor_parallel_size=1)),
}


def _resolve(spec: dict, models: dict) -> dict:
    return dict(spec, model=models[spec["model"]]) if "model" in spec else dict(spec)


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


_PLAIN: dict = {}
_RUNS: dict = {}


def _plain(models: dict, target: str, tp: int) -> dict:
    """Plain greedy outputs (REF_TOKENS long) of every prompt, and the tokenizer."""
    key = (target, tp)
    if key not in _PLAIN:
        with LLM(models[target], tensor_parallel_size=tp, **ENGINE) as llm:
            params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True)
            _PLAIN[key] = dict(ref=_ids(llm.generate(PROMPTS, params, use_tqdm=False)), tokenizer=llm.get_tokenizer())
    return _PLAIN[key]


def _stop_index(ref: list[int]) -> int:
    """An index whose token appears nowhere before it, in the middle of a self-draft run (with
    k = 4 the emissions after the first token are runs of 5: indices 1-5, 6-10, 11-15...)."""
    for i in (7, 8, 12, 13, 17, 18, *range(2, MAX_TOKENS - 1)):
        if ref[i] not in ref[:i]:
            return i
    raise AssertionError(f"no usable stop token in {ref}")


def _mixed_batch(ref: list[list[int]], tok) -> list[tuple]:
    """(prompt, params, check) triples; check(completion) asserts the expected output."""
    batch = []
    for p, r in zip(PROMPTS, ref):
        batch.append((p, GREEDY, ("exact", r[:MAX_TOKENS], "length", None)))
    for p, r in zip(PROMPTS[:2], ref[:2]):
        i = _stop_index(r)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[r[i]])
        batch.append((p, params, ("exact", r[: i + 1], "stop", r[i])))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # drafts are cut to fit
    batch.append((PROMPTS[2], params, ("exact", ref[2][:8], "length", None)))
    text = tok.decode(ref[3][:MAX_TOKENS])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True)
    batch.append((PROMPTS[3], params, ("stop_string", ref[3], text, stop)))
    for p, sp in zip(PROMPTS[:2], SEEDED[:2]):
        batch.append((p, sp, ("sampled",)))
    return batch


def _check(completion, check, tok) -> None:
    kind = check[0]
    if kind == "exact":
        _, ids, reason, stop_reason = check
        assert completion.token_ids == ids  # and so no token past a stop token
        assert (completion.finish_reason, completion.stop_reason) == (reason, stop_reason)
    elif kind == "stop_string":
        _, ref, text, stop = check
        ids = completion.token_ids
        assert ids == ref[: len(ids)] and 0 < len(ids) < MAX_TOKENS
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert completion.text == text[: text.index(stop)]
        # The last token completed the stop string: nothing past it was emitted.
        assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    else:
        assert len(completion.token_ids) == MAX_TOKENS and completion.finish_reason == "length"


def _run(case: str, models: dict) -> dict:
    """One engine per case: the mixed batch, then a clean greedy batch (for exact accounting)."""
    if case not in _RUNS:
        target, tp, spec = CASES[case]
        plain = _plain(models, target, tp)
        ref, tok = plain["ref"], plain["tokenizer"]
        batch = _mixed_batch(ref, tok)
        with LLM(models[target], tensor_parallel_size=tp, speculative_config=_resolve(spec, models), **ENGINE) as llm:
            mixed = llm.generate([b[0] for b in batch], [b[1] for b in batch], use_tqdm=False)
            before = llm.get_stats()
            clean = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            after = llm.get_stats()
        _RUNS[case] = dict(batch=batch, mixed=mixed, clean=_ids(clean), before=before, after=after, ref=ref, tok=tok)
    return _RUNS[case]


# ---- greedy losslessness --------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_output(case, models):
    run = _run(case, models)
    ref = run["ref"]
    assert run["clean"] == [r[:MAX_TOKENS] for r in ref]
    for (prompt, params, check), out in zip(run["batch"], run["mixed"]):
        _check(out.outputs[0], check, run["tok"])
    sampled = [out.outputs[0].token_ids for (_, _, c), out in zip(run["batch"], run["mixed"]) if c[0] == "sampled"]
    assert sampled[0] != ref[0][:MAX_TOKENS]  # the sampled requests really sampled
    stats = run["after"]
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


EXPECTED_ACCEPTANCE = {"self": "all", "perturbed": "partial", "ngram": "partial", "qwen3": "partial", "dflash": "partial"}


@pytest.mark.parametrize("case", list(CASES))
def test_acceptance_and_spec_metrics(case, models):
    """The counters agree with each other and with the tokens generated; a self-draft accepts
    everything; the others accept some drafts and reject others (so rollback really ran)."""
    run = _run(case, models)
    _, _, spec = CASES[case]
    k = spec["num_speculative_tokens"]
    s = run["after"]
    drafts, drafted, accepted, per_pos = (
        s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"], s["num_accepted_tokens_per_pos"]
    )
    assert len(per_pos) == k
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepting position j+1 needs position j
    assert sum(per_pos) == accepted <= drafted <= k * drafts
    assert per_pos[0] <= drafts
    assert drafts > 0
    assert s["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert s["acceptance_rate"] == pytest.approx(accepted / drafted)

    # Clean batch (greedy, no stops): every emitted token is a prompt's first token, an accepted
    # draft or the one bonus/recovered token of a verification round; a round without drafts
    # happens at most once per request (ngram: whenever there is no match).
    b, a = run["before"], s
    d_drafts = a["num_drafts"] - b["num_drafts"]
    d_drafted = a["num_draft_tokens"] - b["num_draft_tokens"]
    d_accepted = a["num_accepted_tokens"] - b["num_accepted_tokens"]
    d_first = a["num_accepted_tokens_per_pos"][0] - b["num_accepted_tokens_per_pos"][0]
    generated = a["num_generation_tokens"] - b["num_generation_tokens"]
    n = len(PROMPTS)
    assert generated == n * MAX_TOKENS
    assert generated >= n + d_drafts + d_accepted
    if spec["method"] != "ngram":
        assert generated <= 2 * n + d_drafts + d_accepted

    kind = EXPECTED_ACCEPTANCE[case.split("-")[0]]
    if kind == "all":  # greedy requests (the mixed batch's sampled ones reject some greedy drafts)
        assert d_accepted == d_drafted > 0 and d_first == d_drafts
        # With 100% acceptance and k = 4, runs of 5 tokens: 1 + 5 + 5 + 5 + 5 + 3 = 24, so no round lacks drafts.
        assert generated == n + d_drafts + d_accepted
    else:  # partial: a verifier that rejected everything (or accepted everything) fails here
        assert kind == "partial"
        assert 0 < d_accepted < d_drafted
        assert per_pos[1] > 0  # some rounds accept two drafts or more, then reject


def test_gemma3_drafting_for_itself_is_lossless_at_tp2(tiny_gemma3):
    """Gemma 3's soft-capped, scaled LM head as a draft model for itself, flag on and off (the
    real 270M model covers vocab 262,144 with its shipped DFlash drafter, tests/models/test_gemma3.py)."""
    with LLM(tiny_gemma3, tensor_parallel_size=2, **ENGINE) as llm:
        plain = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for flag in (False, True):
        spec = dict(_draft("gemma3", flag), model=tiny_gemma3)
        with LLM(tiny_gemma3, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
            assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
            stats = llm.get_stats()
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0  # drafting for itself: all accepted
        assert stats["comm_bytes_per_row"]["draft.sample"] == (8 * 2 if flag else 4 * PADDED_VOCAB)


# ---- communication: the flag never gathers full draft logits -------------------------------------


@pytest.mark.parametrize("draft", ["self", "perturbed", "dflash"])
def test_draft_sample_bytes_per_row_tp2(draft, models):
    """Greedy drafting is identical with the flag on and off, so both runs draft the same rows:
    on, each row moves 8·tp bytes ((value, id) float32 from each rank); off, 4·padded_vocab."""
    on = _run(f"{draft}-flag-tp2", models)["after"]["comm"]["draft.sample"]
    off = _run(f"{draft}-noflag-tp2", models)["after"]["comm"]["draft.sample"]
    rows = off["bytes"] / (4 * PADDED_VOCAB)
    assert rows == on["bytes"] / (8 * 2)
    assert rows == int(rows) > 0
    assert on["calls"] == off["calls"] > 0
    for case in (f"{draft}-flag-tp2", f"{draft}-noflag-tp2"):
        comm = _run(case, models)["after"]["comm"]
        assert "sample" not in comm and comm["verify.sample"]["bytes"] % (4 * PADDED_VOCAB) == 0


def test_replicated_draft_and_ngram_do_not_communicate_for_drafting(models):
    assert "draft.sample" not in _run("perturbed-drafttp1-flag-tp2", models)["after"]["comm"]
    assert "draft.sample" not in _run("ngram-tp2", models)["after"]["comm"]


def test_dflash_drafts_are_identical_at_tp1_and_tp2(models, monkeypatch):
    """The driver runs rank 0's speculator in-process: record every draft it proposes."""
    from tpspec.spec_decode.dflash import DFlashSpeculator

    recorded: list = []
    propose = DFlashSpeculator.propose

    def recording(self, inp):
        fed = propose(self, inp)
        recorded.append([self.drafts(r) for r in inp.req_ids])
        return fed

    monkeypatch.setattr(DFlashSpeculator, "propose", recording)
    drafts = {}
    for tp in (1, 2):
        recorded.clear()
        with LLM(models["llama"], tensor_parallel_size=tp, speculative_config=_resolve(_dflash(True), models), **ENGINE) as llm:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        drafts[tp] = list(recorded)
    assert sum(len(d) for step in drafts[1] for d in step) > 50
    assert drafts[1] == drafts[2]


@pytest.mark.parametrize("mode", ["gathered", "vocab-parallel"])
def test_dflash_probabilistic_flag_drafts_are_sharding_invariant(mode, models):
    """DFlash samples drafts through the target's vocab-parallel LM head even when its layers are
    replicated, so with the flag q stays sharded; seeded output must not depend on TP."""
    spec = _resolve(_dflash(True, draft_sample_method="probabilistic", draft_tensor_parallel_size=1), models)
    prompts, params = PROMPTS[:4] + PROMPTS[:2], SEEDED + [GREEDY] * 2
    outs = {}
    for tp in (1, 2):
        with LLM(models["llama"], tensor_parallel_size=tp, speculative_config=spec, sampling_mode=mode, **ENGINE) as llm:
            outs[tp] = _ids(llm.generate(prompts, params, use_tqdm=False))
            stats = llm.get_stats()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert outs[1] == outs[2]
    ref = _plain(models, "llama", 1)["ref"]
    assert outs[2][4:] == [r[:MAX_TOKENS] for r in ref[:2]]


@pytest.mark.parametrize("tp", [1, 2])
def test_dflash_lossless_under_preemption(tp, models):
    """Recomputed requests rebuild the drafter's context from the target's features again."""
    ref = _plain(models, "llama", tp)["ref"]
    to_the_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    with LLM(models["llama"], tensor_parallel_size=tp, speculative_config=_resolve(_dflash(True), models), **SMALL) as llm:
        outs = llm.generate(PROMPTS[:4], to_the_end, use_tqdm=False)
        stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    for o, r in zip(outs, ref):
        ids = o.outputs[0].token_ids
        assert len(ids) == SMALL["max_model_len"] - len(o.prompt_token_ids) and ids == r[: len(ids)]


class _FullLogitsCalled(Exception):
    pass


def _forbid_compute_logits(llm: LLM) -> None:
    speculator = llm.llm_engine.executor.runner.speculator

    def compute_logits(*args, **kwargs):
        raise _FullLogitsCalled("the draft model's compute_logits was called")

    speculator.model.compute_logits = compute_logits


def test_flag_drafts_without_full_logits_tp1(models):
    ref = _plain(models, "llama", 1)["ref"]
    spec = _draft(models["perturbed"], True)
    with LLM(models["llama"], speculative_config=spec, **ENGINE) as llm:
        _forbid_compute_logits(llm)
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [r[:MAX_TOKENS] for r in ref]
        stats = llm.get_stats()
        assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    with LLM(models["llama"], speculative_config=dict(spec, use_local_argmax_reduction=False), **ENGINE) as llm:
        _forbid_compute_logits(llm)
        with pytest.raises(_FullLogitsCalled):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)


# ---- probabilistic drafting -----------------------------------------------------------------------

_PROB: dict = {}


def _prob_run(models: dict, tp: int) -> dict:
    if tp not in _PROB:
        spec = _draft(models["perturbed"], False, draft_sample_method="probabilistic")
        prompts = PROMPTS + PROMPTS[:4]
        params = [GREEDY] * len(PROMPTS) + SEEDED
        with LLM(models["llama"], tensor_parallel_size=tp, speculative_config=spec, **ENGINE) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            _PROB[tp] = dict(outs=_ids(outs), stats=llm.get_stats())
    return _PROB[tp]


@pytest.mark.parametrize("tp", [1, 2])
def test_probabilistic_drafting_runs_and_greedy_stays_lossless(tp, models):
    run = _prob_run(models, tp)
    ref = _plain(models, "llama", tp)["ref"]
    greedy, seeded = run["outs"][: len(PROMPTS)], run["outs"][len(PROMPTS) :]
    assert greedy == [r[:MAX_TOKENS] for r in ref]
    assert all(len(t) == MAX_TOKENS for t in seeded)
    assert sum(t != r[:MAX_TOKENS] for t, r in zip(seeded, ref)) >= 3  # really sampled
    s = run["stats"]
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    if tp == 2:  # probabilistic drafting needs the full draft distribution: 4·padded_vocab per row
        assert s["comm"]["draft.sample"]["bytes"] % (4 * PADDED_VOCAB) == 0


def test_probabilistic_drafting_is_sharding_invariant(models):
    """Draft noise, acceptance and residual draws are keyed by (seed, position, global token id)."""
    assert _prob_run(models, 2)["outs"] == _prob_run(models, 1)["outs"]


def test_probabilistic_self_draft_accepts_sampled_drafts(models):
    """Drafting from q = p (the target as its own draft, same temperature and filters): a draft
    is accepted iff u·q(d) < p(d), i.e. always, up to rounding. Drafts drawn from anything but the
    request's own processed distribution (e.g. greedy, or ignoring temperature/top-k/top-p) would
    be rejected often at these temperatures."""
    spec = _draft(models["llama"], False, draft_sample_method="probabilistic")
    with LLM(models["llama"], speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate(PROMPTS[:4], SEEDED, use_tqdm=False)
        s = llm.get_stats()
    assert all(len(t) == MAX_TOKENS for t in _ids(outs))
    assert s["num_draft_tokens"] >= 40
    assert s["num_accepted_tokens"] >= 0.95 * s["num_draft_tokens"]


# ---- nothing leaks ------------------------------------------------------------------------------



@pytest.mark.parametrize("tp", [1, 2])
def test_nothing_leaks_under_preemption_and_aborts(tp, models):
    """Every rank keeps a request's tokens, drafts and (probabilistic drafting) a [k, vocab] q
    between steps; they must go when the request ends, as must its KV blocks: at once when the
    rank's own stop check ends it, with the next step after an abort or a stop string (no extra
    step for it). Requests run to max_model_len in a KV cache of exactly max_model_len tokens (the
    drafter's lookahead must not make them unschedulable)."""
    ref = _plain(models, "llama", tp)["ref"]
    spec = _draft(models["perturbed"], False, draft_sample_method="probabilistic")
    with LLM(models["llama"], tensor_parallel_size=tp, speculative_config=spec, **SMALL) as llm:
        engine = llm.llm_engine
        runner = engine.executor.runner
        to_the_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to max_model_len
        requests = {f"long-{i}": (PROMPTS[i], to_the_end) for i in range(4)}
        requests.update({f"sampled-{i}": (PROMPTS[i], SEEDED[i]) for i in range(2)})
        requests["abort-running"] = (PROMPTS[4], SEEDED[2])
        requests["abort-waiting"] = (PROMPTS[3], GREEDY)
        for rid, (prompt, params) in requests.items():
            engine.add_request(prompt, params, request_id=rid)
        final = {"abort-waiting": engine.abort_request("abort-waiting")}
        states = runner.speculator.states  # req id -> DraftState
        records = runner.requests.requests  # req id -> RankRequest
        most_dists = 0
        for _ in range(1000):  # a few hundred steps are needed; more means no progress
            if not engine.has_unfinished_requests():
                break
            unfinished_before = set(engine._tracked)
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            # State only for requests alive at the start of this step (aborted ones are dropped
            # with the next step, finished ones right away).
            assert set(states) <= unfinished_before and set(records) <= unfinished_before
            most_dists = max(most_dists, sum(st.draft_dists is not None for st in states.values()))
            tracked = engine._tracked.get("abort-running")
            if tracked is not None and len(tracked.req.output_token_ids) >= 3:
                final["abort-running"] = engine.abort_request("abort-running")
        assert not engine.has_unfinished_requests(), "the engine stopped making progress"

        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert most_dists >= 2
        assert states == {} and records == {}
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == SMALL["num_kv_blocks"]
        assert stats["num_running"] == stats["num_waiting"] == 0 and not engine._tracked
        assert set(final) == set(requests)
        for i in range(4):
            c = final[f"long-{i}"].outputs[0]
            prompt_len = len(final[f"long-{i}"].prompt_token_ids)
            assert c.finish_reason == "length" and len(c.token_ids) == SMALL["max_model_len"] - prompt_len
            assert c.token_ids == ref[i][: len(c.token_ids)]
        assert final["abort-waiting"].outputs[0].token_ids == []
        assert final["abort-running"].outputs[0].finish_reason == "abort"
        assert 3 <= len(final["abort-running"].outputs[0].token_ids) < MAX_TOKENS

        # The last request aborted mid-flight: its KV blocks are free at once; the ranks drop its
        # state with the next step, which carries its id (no step of its own).
        engine.add_request(PROMPTS[0], SEEDED[0], request_id="idle-abort")
        for _ in range(3):
            engine.step()
        assert set(states) == set(records) == {"idle-abort"} and states["idle-abort"].draft_dists is not None
        steps = engine.stats["num_steps"]
        engine.abort_request("idle-abort")
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_steps"] == steps
        engine.add_request(PROMPTS[1], GREEDY, request_id="next")
        engine.step()
        assert set(states) == set(records) == {"next"}
