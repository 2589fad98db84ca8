"""Bad input gets a clear error naming the problem, raised before anything is queued or spawned,
and the engine keeps serving other requests."""

from __future__ import annotations

import json
import shutil

import psutil
import pytest

from tpspec import LLM, SamplingParams

MAX_LEN = 32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


# --- engine construction ----------------------------------------------------------------------


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(missing)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = tmp_path / "foo"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    before = _children()
    with pytest.raises(ValueError, match="FooForCausalLM") as err:
        LLM(str(folder), tensor_parallel_size=2)
    assert "LlamaForCausalLM" in str(err.value)  # and says what is supported
    assert _children() == before  # nothing was spawned


@pytest.mark.parametrize(
    "tp, why",
    [
        (7, "num_attention_heads"),  # more ranks than the 6 heads
        (3, "intermediate_size"),  # 128 does not split over 3 ranks
        (0, "got 0"),
    ],
)
def test_tensor_parallel_size_that_cannot_split_the_model(tiny_llama, tp, why):
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size") as err:
        LLM(tiny_llama, tensor_parallel_size=tp)
    assert why in str(err.value)
    assert _children() == before


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_model_len=10_000), "max_model_len"),  # beyond max_position_embeddings (512)
        (dict(block_size=0), "block_size"),
        (dict(num_kv_blocks=1, block_size=4, max_model_len=64), "max_model_len"),  # cache < one request
        (dict(dtype="float8"), "dtype"),
        (dict(device="tpu"), "device"),
    ],
)
def test_bad_engine_arguments(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama, **kwargs)


def test_failed_tp_start_stops_its_workers(tiny_llama):
    """A TP engine whose start fails after spawning (here: the KV cache cannot hold one request)
    stops its workers. (Before the module's live engine below: a TP engine must be alone.)"""
    before = _children()
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, tensor_parallel_size=2, num_kv_blocks=1, block_size=4, max_model_len=64)
    assert _children() == before


def test_more_ranks_than_cuda_devices(tiny_llama, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs one CUDA device per rank: 2 on this node; 1 visible"):
        LLM(tiny_llama, tensor_parallel_size=2, device="cuda")
    assert _children() == before


# --- requests on a live engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, num_kv_blocks=32, block_size=4, max_model_len=MAX_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(["def add(a, b):", "import"], GREEDY, use_tqdm=False)]


def _assert_still_serving(llm: LLM, reference) -> None:
    stats = llm.get_stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    outs = llm.generate(["def add(a, b):", "import"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=-1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-5)),
        ("min_p", dict(min_p=2)),
        ("max_tokens", dict(max_tokens=0)),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("logprobs", dict(logprobs=-1)),
        ("n", dict(n=0)),
        ("n", dict(n=65)),
    ],
)
def test_invalid_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "empty"),
        ([], "empty"),
        ([5, 1000], r"\[0, 1000\)"),  # vocab_size is 1000
        ([-1], r"\[0, 1000\)"),
        ([5, True], "token ids"),
        ([5.0], "token ids"),
        (list(range(3, 3 + MAX_LEN)), "max_model_len"),  # no room left to generate
        ("import " * 100, "max_model_len"),
    ],
    ids=["empty-text", "empty-ids", "id-too-big", "id-negative", "bool-id", "float-id", "ids-too-long", "text-too-long"],
)
def test_bad_prompt_is_refused_and_the_engine_keeps_serving(llm, reference, prompt, match):
    before = llm.get_stats()["num_requests"]
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.get_stats()["num_requests"] == before  # nothing was queued
    _assert_still_serving(llm, reference)


def test_bad_prompt_in_a_batch_queues_none_of_it(llm, reference):
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        llm.generate(["def add(a, b):", [5, 99999], "import"], GREEDY, use_tqdm=False)
    _assert_still_serving(llm, reference)


def test_prompt_one_token_short_of_max_model_len_generates_one_token(llm):
    out = llm.generate([list(range(3, 3 + MAX_LEN - 1))], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_wrong_sampling_params_argument(llm, reference):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)  # one per prompt, or one for all
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="already in use"):
        engine = llm.llm_engine
        engine.add_request("a", GREEDY, request_id="dup")
        try:
            engine.add_request("b", GREEDY, request_id="dup")
        finally:
            engine.abort_request("dup")
    _assert_still_serving(llm, reference)
