"""Nothing leaks: whichever way requests end (EOS, max_tokens, stop string, stop token, aborted while
running or waiting) and however often they are preempted, every KV block is free again afterwards;
preemption (recompute) and chunked prefill do not change greedy outputs."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tpspec import LLM, SamplingParams

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import",
    "Tensor parallelism splits the vocabulary across ranks, and",
    "for i in range(10):\n    print(i)\nimport os\nimport sys\n",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.5, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(PROMPTS))]
# A KV cache of 16 blocks of 4 tokens holds 64 tokens: one request of max_model_len, but far
# fewer than the batch needs (5 prompts of 1-19 tokens + 24 generated each).
SMALL = dict(num_kv_blocks=16, block_size=4, max_model_len=64)
BIG = dict(num_kv_blocks=256, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory) -> dict:
    """The tiny Llama's greedy outputs (big cache, no preemption), and a copy of the model whose
    config.json names one of the tokens it generates as EOS, so a request can really end at EOS."""
    with LLM(tiny_llama, **BIG) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
        assert llm.get_stats()["num_preemptions"] == 0
        tok = llm.get_tokenizer()
    ref = [o.outputs[0].token_ids for o in outs]
    eos = ref[0][5]
    folder = str(tmp_path_factory.mktemp("tiny-llama-eos"))
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dict(ref=ref, seeded=[o.outputs[0].token_ids for o in seeded], eos=eos, folder=folder, tokenizer=tok)


@pytest.fixture(scope="module")
def small(model):
    with LLM(model["folder"], **SMALL) as llm:
        yield llm


def _assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == SMALL["num_kv_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    engine = llm.llm_engine
    assert not engine.scheduler.requests and not engine._tracked  # no per-request state left behind


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_preempted_requests_give_the_same_output(small, model, kind):
    """Recompute after preemption reproduces the KV cache exactly, and seeded noise is keyed by
    position, so neither greedy nor seeded outputs change."""
    before = small.get_stats()["num_preemptions"]
    outs = small.generate(PROMPTS, GREEDY if kind == "greedy" else SEEDED, use_tqdm=False)
    assert small.get_stats()["num_preemptions"] > before
    assert [o.outputs[0].token_ids for o in outs] == model["ref" if kind == "greedy" else "seeded"]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    _assert_all_free(small)


def test_every_way_of_ending_frees_all_blocks(small, model):
    ref, eos, tok = model["ref"], model["eos"], model["tokenizer"]
    engine = small.llm_engine
    before = small.get_stats()["num_preemptions"]
    eos_at = ref[0].index(eos)
    # Requests that do not ignore EOS would otherwise end early, at EOS (the config's or </s>).
    assert not {eos, 2} & set(ref[1][:7] + ref[2][:7] + ref[0][:eos_at])
    ref_text = tok.decode(ref[3])
    stop_str = ref_text[len(ref_text) // 3 : len(ref_text) // 3 + 3]
    assert len(stop_str) == 3
    stop_tok = ref[2][6]
    requests = {
        "eos": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)),
        "length": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=7)),
        "stop_token": (PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_tok])),
        "stop_string": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop_str], ignore_eos=True)),
        "abort_running": (PROMPTS[4], GREEDY),
        "long_a": (PROMPTS[4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        "long_b": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        "abort_waiting": (PROMPTS[3], GREEDY),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    final, streamed = {}, {rid: "" for rid in requests}
    final["abort_waiting"] = engine.abort_request("abort_waiting")
    assert engine.abort_request("no-such-request") is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                final[out.request_id] = out
        running = final.get("abort_running") is None and engine._tracked["abort_running"].req
        if running and len(running.output_token_ids) >= 3:
            final["abort_running"] = engine.abort_request("abort_running")

    assert small.get_stats()["num_preemptions"] > before
    _assert_all_free(small)
    assert set(final) == set(requests)
    got = {rid: o.outputs[0] for rid, o in final.items()}
    reasons = {rid: (c.finish_reason, c.stop_reason) for rid, c in got.items()}
    assert reasons == {
        "eos": ("stop", None),
        "length": ("length", None),
        "stop_token": ("stop", stop_tok),
        "stop_string": ("stop", stop_str),
        "abort_running": ("abort", None),
        "long_a": ("length", None),
        "long_b": ("length", None),
        "abort_waiting": ("abort", None),
    }
    assert got["eos"].token_ids == ref[0][: eos_at + 1]
    assert got["length"].token_ids == ref[1][:7]
    assert got["stop_token"].token_ids == ref[2][: ref[2].index(stop_tok) + 1]
    stop_ids = got["stop_string"].token_ids
    assert stop_ids == ref[3][: len(stop_ids)] and len(stop_ids) < MAX_TOKENS
    assert got["stop_string"].text == ref_text[: ref_text.index(stop_str)]
    assert 3 <= len(got["abort_running"].token_ids) < MAX_TOKENS
    assert got["abort_running"].token_ids == ref[4][: len(got["abort_running"].token_ids)]
    assert got["long_a"].token_ids[:MAX_TOKENS] == ref[4] and len(got["long_a"].token_ids) == 40
    assert got["long_b"].token_ids[:MAX_TOKENS] == ref[1]
    assert got["abort_waiting"].token_ids == []
    # Streamed deltas add up to the final text, held-back stop-string prefixes included.
    for rid, c in got.items():
        assert streamed[rid] == c.text or rid == "abort_waiting", rid

    # The engine keeps serving afterwards.
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == ref[:2]
    _assert_all_free(small)


def test_interrupted_generate_ends_its_requests(small, model, monkeypatch):
    """Ctrl-C inside LLM.generate: its requests are aborted, not left running in the engine to
    hold blocks and be computed by the next call."""
    engine = small.llm_engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        small.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    _assert_all_free(small)
    outs = small.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == model["ref"][:2]
    _assert_all_free(small)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=5),  # every prompt but one is split into chunks
        dict(max_num_batched_tokens=8, **SMALL),  # chunks and preemption together
        dict(max_num_batched_tokens=64, enable_chunked_prefill=False),
    ],
    ids=["chunked", "chunked-preempted", "unchunked"],
)
def test_chunked_prefill_gives_the_same_output(model, engine_args):
    args = dict(BIG, **engine_args)
    with LLM(model["folder"], **args) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == model["ref"]
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert (stats["num_preemptions"] > 0) == (args["num_kv_blocks"] == SMALL["num_kv_blocks"])
    longest = max(len(o.prompt_token_ids) for o in outs)
    budget = args["max_num_batched_tokens"]
    if args.get("enable_chunked_prefill", True) and budget < longest:
        # The longest prompt alone needs ceil(longest / budget) prefill steps, then 23 decodes.
        assert stats["num_steps"] >= -(-longest // budget) + MAX_TOKENS - 1
    else:
        assert stats["num_steps"] == MAX_TOKENS


def test_a_lone_sequence_gets_consecutive_blocks():
    """Lowest free block first: after others freed theirs out of order, a request that grows one
    block at a time alone still gets consecutive blocks (attention then reads them in place)."""
    from tpspec.engine.kv_cache import BlockManager
    from tpspec.engine.sequence import Request

    def request(name: str) -> Request:
        return Request(name, [1], SamplingParams(), seed=0, max_tokens=16, eos_token_ids=frozenset())

    manager = BlockManager(num_blocks=16, block_size=4)
    first, second = request("a"), request("b")
    for n in range(1, 6):  # interleaved growth: a gets 0, 2, 4, ...; b gets 1, 3, 5, ...
        assert manager.allocate(first, 4 * n) and manager.allocate(second, 4 * n)
    manager.free(second)
    manager.free(first)
    lone = request("c")
    for tokens in range(1, 33):
        assert manager.allocate(lone, tokens)
    assert lone.block_ids == list(range(8))
    assert manager.num_free_blocks == 8
