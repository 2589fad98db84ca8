"""Any speculation length is lossless, end to end through ``LLM``.

Each request's k is drawn at random at every step (0 … num_speculative_tokens, k = 0 included;
the controller's choice replaced by a seeded draw), with chunked prefill (a small token budget)
and preemption (a small KV cache):

* greedy output equals plain output token for token, for every method, TP 1 and 2, the flag on
  and off;
* the drafter's state stays valid whatever k was: a self-draft (the target as its own draft
  model) has every draft accepted, and DFlash, EAGLE-3 and MTP propose, at every position, the
  drafts a pinned-k run proposes at the same position (for DFlash, blocks of the same length), so
  no k = 0 step left their KV cache or context features stale;
* the adaptive controller itself (no random draws) is lossless too.

Engines are created, used and shut down inside memoized run functions (one TP group per process).
"""

from __future__ import annotations

import random

import pytest

from tests.models.test_eagle3 import write_eagle3
from tests.models.test_mtp import write_mtp
from tpspec import LLM, SamplingParams
from tpspec.engine.speculation.controller import SpeculationLengthController
from tpspec.spec_decode.speculator import DraftModelSpeculator
from tpspec.worker.model_runner import ModelRunner

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import",
    "Tensor parallelism splits the vocabulary across ranks, and",
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # a repeated pattern: ngram proposes at once
]
K = 4
# 24 blocks of 4 tokens for 5 requests of up to 64: preemption; 12 tokens a step: chunked prefill.
ENGINE = dict(num_kv_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=12)
# Room for everything: prefill chunks and preemptions do not depend on k, so two runs differ in k alone.
ROOMY = dict(num_kv_blocks=128, block_size=4, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def drafters(tiny_llama, tiny_dflash, tmp_path_factory) -> dict[str, str]:
    return {"self": tiny_llama, "dflash": tiny_dflash, "eagle3": write_eagle3(str(tmp_path_factory.mktemp("eagle3")), seed=4),
            "mtp": write_mtp(str(tmp_path_factory.mktemp("mtp")), tiny_llama, seed=4)}


def _spec(method: str, drafters: dict, flag: bool, **kw) -> dict:
    spec = dict(method=method, num_speculative_tokens=K, **kw)
    if method == "ngram":
        return dict(spec, prompt_lookup_min=1)
    model = drafters["self" if method == "draft_model" else method]
    return dict(spec, model=model, use_local_argmax_reduction=flag)


CASES = {  # name: (method, tp, flag)
    "ngram-tp1": ("ngram", 1, False),
    "ngram-tp2": ("ngram", 2, False),
    "self-flag-tp1": ("draft_model", 1, True),
    "self-noflag-tp2": ("draft_model", 2, False),
    "dflash-flag-tp1": ("dflash", 1, True),
    "dflash-noflag-tp1": ("dflash", 1, False),
    "dflash-flag-tp2": ("dflash", 2, True),
    "eagle3-flag-tp1": ("eagle3", 1, True),
    "eagle3-noflag-tp2": ("eagle3", 2, False),
    "mtp-flag-tp1": ("mtp", 1, True),
}


def _random_ks(self, reqs, real_rows):
    """In place of the controller's choice: each request's k drawn from 0 … its cap."""
    caps = [max(r.max_propose, min(r.num_held, r.max_verify)) if r.samples else 0 for r in reqs]
    return [self._rng.randint(0, c) for c in caps]


def _record_drafts(monkeypatch) -> list[tuple[str, int, list[int], int]]:
    """(request id, position of its first draft, drafts, the first position its drafter read) of
    every proposal on rank 0."""
    recorded: list = []
    propose = ModelRunner._propose

    def recording(self, seqs, sampled, wanted, *rest):
        fed_rows = propose(self, seqs, sampled, wanted, *rest)
        for s, n in zip(seqs, wanted):
            if n:
                recorded.append((s.req_id, s.req.num_tokens, list(self.speculator.drafts(s.req_id)),
                                 self.speculator.context_start(s.req_id)))
        return fed_rows

    monkeypatch.setattr(ModelRunner, "_propose", recording)
    return recorded


_RUNS: dict = {}


def _generate(target: str, tp: int, spec: dict | None, engine: dict) -> tuple[list[list[int]], dict]:
    with LLM(target, tensor_parallel_size=tp, speculative_config=spec, **engine) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_stats()


def _run(key: tuple, target: str, drafters: dict, monkeypatch, roomy: bool = False) -> dict:
    """key: (method, tp, flag, mode), mode "random" (random k), "random-cap" (random k, the
    drafter dropping its deferred rows past 2 tokens), "pinned" (k = K) or "adaptive"; ``roomy``: the ROOMY
    engine instead of ENGINE."""
    key = (*key, roomy)
    engine = ROOMY if roomy else ENGINE
    if key not in _RUNS:
        method, tp, flag, mode, _ = key
        if method is None:
            tokens, stats = _generate(target, tp, None, engine)
            _RUNS[key] = dict(tokens=tokens, stats=stats)
        else:
            spec = _spec(method, drafters, flag, **({"adaptive": False} if mode == "pinned" else {}))
            with monkeypatch.context() as m:
                if mode == "random-cap":
                    m.setattr(DraftModelSpeculator, "max_deferred_tokens", 2)
                if mode.startswith("random"):
                    m.setattr(SpeculationLengthController, "_rng", random.Random(7), raising=False)
                    m.setattr(SpeculationLengthController, "_adaptive_ks", _random_ks)
                drafts = _record_drafts(m)
                tokens, stats = _generate(target, tp, spec, engine)
            _RUNS[key] = dict(tokens=tokens, stats=stats, drafts=list(drafts))
    return _RUNS[key]


@pytest.mark.parametrize("case", list(CASES))
def test_random_k_is_lossless(case, tiny_llama, drafters, monkeypatch):
    method, tp, flag = CASES[case]
    plain = _run((None, tp, False, "plain"), tiny_llama, drafters, monkeypatch)
    run = _run((method, tp, flag, "random"), tiny_llama, drafters, monkeypatch)
    assert run["tokens"] == plain["tokens"]
    s = run["stats"]
    hist = s["num_speculative_tokens_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0 and hist[K] > 0  # k really varied, 0 and the maximum included
    assert s["num_preemptions"] > 0  # the small cache preempted (and recomputed) requests
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    if method == "draft_model":  # self-draft: a draft is wrong only if the drafter's state went stale
        assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 0


@pytest.mark.parametrize(
    "case,mode",
    [("dflash-flag-tp1", "random"), ("dflash-flag-tp2", "random"), ("dflash-flag-tp1", "random-cap"),
     ("eagle3-flag-tp1", "random"), ("eagle3-noflag-tp2", "random"), ("eagle3-flag-tp1", "random-cap"),
     ("mtp-flag-tp1", "random")],
)
def test_drafts_do_not_depend_on_earlier_k(case, mode, tiny_llama, drafters, monkeypatch):
    """Whatever k a request had before (0 included: DFlash and the chain heads defer their feed
    then), its drafter proposes what it would with k pinned, as long as it kept its whole backlog.
    With "random-cap" a backlog past 2 tokens is dropped and the drafter's context starts after
    it: the output stays plain decoding's, and the drafts before any drop still match."""
    method, tp, flag = CASES[case]
    random_run = _run((method, tp, flag, mode), tiny_llama, drafters, monkeypatch, roomy=True)
    pinned = _run((method, tp, flag, "pinned"), tiny_llama, drafters, monkeypatch, roomy=True)
    cut = [start for *_, start in random_run["drafts"] if start > 0]
    assert bool(cut) == (mode == "random-cap")  # ROOMY's prompts take no cached block
    if mode == "random-cap":
        plain = _run((None, tp, False, "plain"), tiny_llama, drafters, monkeypatch, roomy=True)
        assert random_run["tokens"] == plain["tokens"]
    # (A chain head's KV at a prefill chunk's last position stays unwritten, so there chunk
    # boundaries, which the token budget left by drafts moves, change its drafts: ROOMY has none.)
    # The same request reaches the same position with the same tokens in both runs (greedy): the
    # drafter, fed the same history, must propose the same drafts there, for the same k (a DFlash
    # block's drafts see each other, so they depend on its length; a chain's first j do not).
    reference = {(r, pos): d for r, pos, d, _ in pinned["drafts"]}
    common = [(d, reference[(r, pos)]) for r, pos, d, start in random_run["drafts"] if (r, pos) in reference and start == 0]
    if method == "dflash":
        common = [(a, b) for a, b in common if len(a) == len(b)]
    assert len(common) >= 5
    assert all(a[: len(b)] == b[: len(a)] for a, b in common)


@pytest.mark.parametrize("case", ["ngram-tp1", "dflash-flag-tp2", "eagle3-flag-tp1"])
def test_adaptive_controller_is_lossless(case, tiny_llama, drafters, monkeypatch):
    method, tp, flag = CASES[case]
    plain = _run((None, tp, False, "plain"), tiny_llama, drafters, monkeypatch)
    run = _run((method, tp, flag, "adaptive"), tiny_llama, drafters, monkeypatch)
    assert run["tokens"] == plain["tokens"]
    s = run["stats"]
    assert s["speculation_length"] == "adaptive" and s["num_timed_steps"] > 0
    assert sum(s["num_speculative_tokens_histogram"]) > 0
    assert s["step_time_predicted_s_total"] > 0 and s["step_time_measured_s_total"] > 0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_chain_head_step_without_drafts_runs_no_head(method, tiny_llama, drafters, monkeypatch):
    """A step in which no decoding request proposes (k = 0 for all) costs the chain head nothing:
    its rows wait (``DeferredRows``) and are fed with the step in which the request proposes."""
    from tpspec.spec_decode.chain_head import ChainHeadProposer

    calls = []  # per propose call: (anyone proposing, every sequence sampled, head forwards)
    runs = [0]  # head forwards so far (an ended request's settled feed for prefix caching included)
    propose, run = ChainHeadProposer._propose, ChainHeadProposer._run

    def counting_run(self, *args, **kwargs):
        runs[0] += 1
        return run(self, *args, **kwargs)

    def counting_propose(self, inp, states):
        before = runs[0]
        out = propose(self, inp, states)
        calls.append([any(inp.num_drafts), all(inp.sampled), runs[0] - before])
        return out

    def every_other_step(self, reqs, real_rows):  # random k, and k = 0 for all on every other step
        self._step = getattr(self, "_step", 0) + 1
        return _random_ks(self, reqs, real_rows) if self._step % 2 else [0] * len(reqs)

    monkeypatch.setattr(ChainHeadProposer, "_run", counting_run)
    monkeypatch.setattr(ChainHeadProposer, "_propose", counting_propose)
    monkeypatch.setattr(SpeculationLengthController, "_rng", random.Random(3), raising=False)
    monkeypatch.setattr(SpeculationLengthController, "_adaptive_ks", every_other_step)
    plain = _run((None, 1, False, "plain"), tiny_llama, drafters, monkeypatch, roomy=True)
    tokens, _ = _generate(tiny_llama, 1, _spec(method, drafters, True), ROOMY)
    assert tokens == plain["tokens"]
    idle = [n for proposing, sampled, n in calls if not proposing and sampled]
    assert len(idle) >= 5 and not any(idle)
    assert any(n for proposing, _, n in calls if proposing)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_step_time_model_learns_from_the_rows_the_drafter_fed(method, tiny_llama, drafters, monkeypatch):
    """A request that proposes after steps without drafts feeds its backlog in that step: the
    step-time model is corrected with the rows the drafter fed, backlog included, not with the
    step's kept tokens. (Charged to one row, one probe's backlog once made a 1-row feed look as
    dear as a 60-row one, and the controller held speculation off at concurrency 1.)"""
    from tpspec.models.dflash import DFlashDraftModel
    from tpspec.spec_decode.chain_head import ChainHeadProposer
    from tpspec.engine.speculation.step_time import StepTimeModel

    fed: list[int] = []  # per step: rows the drafter's feed ran (chain heads' refeed, DFlash's context writes)
    observed: list[int] = []  # per step: the rows the step-time model was told
    run, write, observe, propose = (ChainHeadProposer._run, DFlashDraftModel.write_context, StepTimeModel.observe,
                                    ModelRunner._propose)

    def counting_run(self, ids, *args, **kwargs):
        if "step" not in kwargs:  # the refeed (a chain pass names its step)
            fed[-1] += len(ids)
        return run(self, ids, *args, **kwargs)

    def counting_write(self, features, *args):
        if fed:  # not the start-up profile's
            fed[-1] += features.shape[0]
        return write(self, features, *args)

    def new_step(self, *args):
        fed.append(0)
        return propose(self, *args)

    def recording_observe(self, target_rows, seqs, fed_rows, *args, **kwargs):
        observed.append(fed_rows)
        return observe(self, target_rows, seqs, fed_rows, *args, **kwargs)

    def three_idle_steps_in_four(self, reqs, real_rows):  # backlogs of 3 steps, then random k
        self._step = getattr(self, "_step", 0) + 1
        return _random_ks(self, reqs, real_rows) if self._step % 4 == 0 else [0] * len(reqs)

    monkeypatch.setattr(ChainHeadProposer, "_run", counting_run)
    monkeypatch.setattr(DFlashDraftModel, "write_context", counting_write)
    monkeypatch.setattr(ModelRunner, "_propose", new_step)
    monkeypatch.setattr(StepTimeModel, "observe", recording_observe)
    monkeypatch.setattr(SpeculationLengthController, "_rng", random.Random(5), raising=False)
    monkeypatch.setattr(SpeculationLengthController, "_adaptive_ks", three_idle_steps_in_four)
    plain = _run((None, 1, False, "plain"), tiny_llama, drafters, monkeypatch, roomy=True)
    tokens, _ = _generate(tiny_llama, 1, _spec(method, drafters, True), ROOMY)
    assert tokens == plain["tokens"]
    assert len(observed) == len(fed) > 20 and observed == fed
