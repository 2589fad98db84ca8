"""Prefix caching through the engine on tiny random checkpoints: greedy outputs with the cache
equal those without it for every drafting method, at TP 1 and 2, with chunked prefill, and on
Gemma 3's sliding-window layers; the later requests of the workload take cached blocks (a shared
system prompt, a repeated prompt, a chat that resends its history); a prompt's acceptance with a
hit equals its acceptance without; afterwards every block is free or cached, and cached ones are
reused. (The shipped EAGLE-3 and DFlash heads on the real model: test_prefix_cache_drafters.py;
EAGLE-3's drafting loop, the chain head, runs here through MTP at TP 1 and 2.)"""

from __future__ import annotations

import random

import torch

import pytest

from tpspec import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=96, block_size=8, max_model_len=160)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _workload() -> list[list[int]]:
    """Token-id prompts, sent one at a time: three questions after one 43-token system prompt, the
    first prompt again, and a prefix of it ending exactly on a block boundary."""
    rng = random.Random(0)
    system = [rng.randrange(3, 390) for _ in range(43)]
    prompts = [system + [rng.randrange(3, 390) for _ in range(n)] for n in (5, 9, 2)]
    return prompts + [prompts[0], prompts[0][:40]]


def _run(target: str, tp: int, spec: dict | None, caching: bool, **engine) -> dict:
    """The workload through one engine, then a chat turn that resends the first exchange: tokens
    per request, accepted drafts per request, and the engine's stats."""
    with LLM(target, tensor_parallel_size=tp, speculative_config=spec, enable_prefix_caching=caching,
             **{**ENGINE, **engine}) as llm:
        tokens, accepted = [], []
        prompts = _workload()
        for i in range(len(prompts) + 1):
            if i == len(prompts):  # the chat's next turn: its history, the answer, a new question
                prompts.append(prompts[0] + tokens[0] + [7, 11, 13])
            before = llm.get_stats().get("num_accepted_tokens", 0)
            tokens.append(llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
            accepted.append(llm.get_stats().get("num_accepted_tokens", 0) - before)
        stats = llm.get_stats()
        # Afterwards nothing is referenced: every block is free, the cached ones among them, and reusable.
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        if caching:
            assert stats["num_cached_kv_blocks"] > 0
            hits = stats["prefix_cache_hits"]
            assert llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens[1]
            assert llm.get_stats()["prefix_cache_hits"] - hits == (len(prompts[1]) - 1) // ENGINE["block_size"] * 8
    return dict(tokens=tokens, accepted=accepted, stats=stats)


_RUNS: dict[str, dict] = {}


def _cached_run(key: str, *args, **kwargs) -> dict:
    if key not in _RUNS:
        _RUNS[key] = _run(*args, **kwargs)
    return _RUNS[key]


@pytest.fixture(scope="module")
def tiny_mtp(tiny_llama, tmp_path_factory) -> str:
    from tests.models.test_mtp import write_mtp

    return write_mtp(str(tmp_path_factory.mktemp("tiny-mtp")), tiny_llama, seed=4)


def _self_draft(flag: bool = True) -> dict:
    return dict(method="draft_model", num_speculative_tokens=3, adaptive=False, use_local_argmax_reduction=flag)


# name: (tp, speculative config ("model" names a fixture), engine extras)
CASES = {
    "plain-tp1": (1, None, {}),
    "plain-tp2-chunked": (2, None, dict(max_num_batched_tokens=16)),
    "self-draft-tp1": (1, dict(_self_draft(), model="tiny_llama"), {}),
    "self-draft-tp2": (2, dict(_self_draft(False), model="tiny_llama"), {}),
    "dflash-tp1-chunked": (1, dict(method="dflash", model="tiny_dflash", num_speculative_tokens=4, adaptive=False),
                           dict(max_num_batched_tokens=16)),
    "dflash-tp2-flag": (2, dict(method="dflash", model="tiny_dflash", num_speculative_tokens=4, adaptive=False,
                                use_local_argmax_reduction=True), {}),
    "mtp-tp1-chunked": (1, dict(method="mtp", model="tiny_mtp", num_speculative_tokens=3, adaptive=False),
                        dict(max_num_batched_tokens=16)),
    "mtp-tp2": (2, dict(method="mtp", model="tiny_mtp", num_speculative_tokens=3, adaptive=True), {}),
    "ngram-tp1": (1, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False), {}),
    "ngram-tp2-vocab-parallel": (2, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False),
                                 dict(sampling_mode="vocab-parallel")),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_with_the_cache_equals_output_without(case, tiny_llama, request):
    tp, spec, engine = CASES[case]
    if spec is not None and "model" in spec:
        spec = dict(spec, model=request.getfixturevalue(spec["model"]))
    plain = _cached_run("plain-nocache", tiny_llama, 1, None, False)
    got = _cached_run(case, tiny_llama, tp, spec, True, **engine)
    assert got["tokens"] == plain["tokens"]
    s = got["stats"]
    bs = ENGINE["block_size"]
    # The second and third questions and the repeat take the system prompt's 5 full blocks; the
    # 40-token prefix 4 (its last token is computed); the chat turn the 7 full blocks of the first
    # exchange (48 prompt tokens + 15 of its 16 outputs computed), drafter feed included.
    assert s["prefix_cache_hits"] == (5 + 5 + 5 + 4 + 7) * bs
    assert s["prefix_cache_queries"] == sum(len(p) for p in _workload()) + len(_workload()[0]) + 16 + 3
    if spec is not None and spec["method"] != "ngram" and not spec["adaptive"]:
        assert s["num_draft_tokens"] > 0  # (adaptive: a random drafter may be held off: its feed deferred)
    # The repeated prompt (a hit on all its full blocks) accepts what it accepted cold.
    assert got["accepted"][3] == got["accepted"][0]
    if case.startswith("self-draft"):
        assert got["accepted"][0] > 0


def test_cache_off_takes_nothing_and_changes_nothing(tiny_llama):
    off = _cached_run("plain-nocache", tiny_llama, 1, None, False)
    s = off["stats"]
    assert s["prefix_cache_hits"] == s["prefix_cache_queries"] == s["num_cached_kv_blocks"] == 0


def test_sliding_window_layers_with_the_cache(tiny_gemma3):
    """Gemma 3's window (4 tokens here) is shorter than the cached prefixes: its sliding layers read
    cached keys within the window only, as without the cache."""
    off = _run(tiny_gemma3, 1, None, False)
    on = _run(tiny_gemma3, 1, None, True, max_num_batched_tokens=16)
    assert on["tokens"] == off["tokens"] and on["stats"]["prefix_cache_hits"] > 0


def _drafter_kv_of_last_request(target: str, spec: dict, prompts: list[list[int]]) -> tuple[torch.Tensor, int]:
    """The prompts one at a time through a TP 1 engine with the cache (8-token chunks); the
    drafter's K and V at every computed position of the last request, read when it ends:
    [2 · layers, positions, heads, dim]; and the tokens taken from the cache. The KV cache in
    float32: a cold start computes the shared rows in other steps than a hit, and where the
    products depend on the step's rows (the tiny models' float16 weight copies on the AVX2 paths)
    their last-bit differences (~1e-6) flip a float16 cache entry's rounding (one unit, 5e-4)."""
    from tpspec.worker.model_runner import ModelRunner

    seen = {}
    forget = ModelRunner.forget_request

    def snapshot(runner, req_id):
        req = runner.requests.requests.get(req_id)
        spec_ = runner.speculator
        if req is not None:
            bs = runner.block_size
            slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(req.num_tokens - 1)])
            caches = getattr(spec_, "kv_caches", None) or [spec_.kv_cache]
            seen[req_id] = torch.cat([torch.stack([k[slots], v[slots]]) for k, v in caches])
        forget(runner, req_id)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "forget_request", snapshot)
        engine = {**ENGINE, "max_num_batched_tokens": 8, "kv_cache_dtype": "float32"}
        with LLM(target, speculative_config=spec, **engine) as llm:
            for i, p in enumerate(prompts):
                llm.llm_engine.add_request(p, GREEDY, request_id=f"r{i}")
                while llm.llm_engine.has_unfinished_requests():
                    llm.llm_engine.step()
            hits = llm.get_stats()["prefix_cache_hits"]
    return seen[f"r{len(prompts) - 1}"], hits


@pytest.mark.parametrize("method", ["mtp", "dflash", "draft_model"])
def test_the_drafters_kv_after_a_hit_equals_a_cold_starts(method, tiny_llama, tiny_dflash, tiny_mtp):
    """Two prompts share 5 full blocks and then part right after a block boundary (the case where
    an EAGLE-3/MTP head's last row of the shared block reads a different next token). The drafter's
    KV at every computed position of the second request is the same whether its shared blocks came
    from the cache or were computed by itself: prompt rows, chunk boundaries (the chain head's
    waiting row), decode steps and the short feed it put off at its end (fed when it ended)."""
    model = {"mtp": tiny_mtp, "dflash": tiny_dflash, "draft_model": tiny_llama}[method]
    spec = dict(method=method, model=model, num_speculative_tokens=3, adaptive=False)
    rng = random.Random(1)
    shared = [rng.randrange(3, 390) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 390) for _ in range(6)], shared + [rng.randrange(3, 390) for _ in range(7)]]
    cold, none = _drafter_kv_of_last_request(tiny_llama, spec, prompts[1:])  # alone: nothing to take
    warm, hits = _drafter_kv_of_last_request(tiny_llama, spec, prompts)  # after the first
    # 5 blocks taken; 4 for MTP, whose 5th block's identity includes the token after it, where they part.
    assert (none, hits) == (0, 32 if method == "mtp" else 40)
    assert warm.shape == cold.shape and warm.abs().amax(dim=(0, 2, 3)).min() > 0  # every position written
    torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_a_request_held_at_k0_costs_the_drafter_nothing_and_a_taker_drafts_after_its_blocks(
    method, tiny_llama, tiny_dflash, tiny_mtp, monkeypatch
):
    """Adaptive speculation held at k = 0 for a whole request (no drafts, no probes): its drafter
    never runs, neither while it is held nor at its end (a backlog longer than
    ``max_flushed_tokens`` is given up, not fed), and its blocks are cached without drafter KV. A
    later request with the same prompt takes them, starts its drafter's context after them
    (``drafter_start``), drafts from there, and its output is plain decoding's."""
    from tpspec.engine.speculation import controller
    from tpspec.spec_decode.chain_head import ChainHeadProposer
    from tpspec.spec_decode.dflash import DFlashSpeculator

    model = {"mtp": tiny_mtp, "dflash": tiny_dflash}[method]
    spec = dict(method=method, model=model, num_speculative_tokens=3)
    prompt = _workload()[0]  # 48 tokens: a backlog of 47 + 15 rows when it ends
    drafter_runs = []
    feed = (ChainHeadProposer, "_run") if method == "mtp" else (DFlashSpeculator, "_write_context")
    original = getattr(*feed)

    def counting(self, *args, **kwargs):
        drafter_runs.append(sorted(self.states))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(*feed, counting)
    monkeypatch.setattr(controller, "PROBE_INTERVAL", 10**9)
    monkeypatch.setattr(controller.SpeculationLengthController, "_adaptive_ks",
                        lambda self, reqs, real_rows: [3 if r.req_id == "taker" and r.samples else 0 for r in reqs])
    outputs = {}
    with LLM(tiny_llama, **ENGINE) as llm:
        outputs["plain"] = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(tiny_llama, speculative_config=spec, **ENGINE) as llm:
        engine = llm.llm_engine
        for req_id in ("held", "taker"):
            engine.add_request(prompt, GREEDY, request_id=req_id)
            taker = engine.scheduler.requests.get("taker")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[req_id] = out.outputs[0].token_ids
                if taker is not None and not taker.status.finished:
                    start = taker.drafter_start
            if req_id == "held":
                assert drafter_runs == []
        stats = llm.get_stats()
    assert start == 40  # the 5 taken blocks lack drafter KV: the taker's context starts after them
    assert stats["prefix_cache_hits"] == 40
    assert drafter_runs and all(states == ["taker"] for states in drafter_runs)
    assert stats["num_draft_tokens"] > 0
    assert outputs["held"] == outputs["taker"] == outputs["plain"]
