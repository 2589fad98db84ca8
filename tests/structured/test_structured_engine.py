"""Structured outputs through ``LLM`` on tiny random checkpoints: n-gram, draft model (greedy and
probabilistic drafts), DFlash and MTP, TP 1 and 2, the flag on and off, gathered and
vocab-parallel sampling (EAGLE-3: tests/structured/test_default_model.py, with the shipped head).

* Greedy output under a grammar is the same with and without speculation (lossless), and the
  same at TP 1 and TP 2; seeded sampled requests give the same tokens at both.
* Every output that ends by itself validates against its schema (``jsonschema``), matches its
  regex or is one of its choices; the schemas are bounded, so a random model completes most.
* The grammar adds no communication: vocab-parallel bytes per row are those of an unconstrained run.
* A grammar's state ends with its request, however it ends.
"""

from __future__ import annotations


import pytest

from tpspec import LLM, SamplingParams
from tpspec.sampling_params import StructuredOutputsParams

from .outputs import assert_satisfies

ENGINE = dict(num_kv_blocks=128, block_size=8, max_model_len=256)
PROMPTS = ["def add(a, b):", "The quick brown fox", "import os", "Tensor parallelism"]
MAX_TOKENS = 120

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                      "required": ["name"], "additionalProperties": False},
        },
        "required": ["id", "owner"], "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 3},
    "enum-nullable": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "note": {"type": ["string", "null"], "maxLength": 4}},
        "required": ["color", "note"], "additionalProperties": False,
    },
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}
REGEX = r"[a-c]{2}-[0-9]{1,3}"
CHOICES = ["alpha", "beta gamma", 'say "hi"']


def _constraints() -> list[tuple[str, StructuredOutputsParams]]:
    out = [(name, StructuredOutputsParams(json=schema, disable_any_whitespace=True)) for name, schema in SCHEMAS.items()]
    return out + [("regex", StructuredOutputsParams(regex=REGEX)), ("choice", StructuredOutputsParams(choice=CHOICES))]


def _requests() -> list[tuple[str, str, SamplingParams]]:
    """(constraint name, prompt, params): each constraint greedy on one prompt, and seeded on another."""
    reqs = []
    for i, (name, so) in enumerate(_constraints()):
        reqs.append((name, PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)))
        reqs.append((name, PROMPTS[(i + 1) % len(PROMPTS)],
                     SamplingParams(temperature=1.0, seed=100 + i, top_k=50, max_tokens=MAX_TOKENS, structured_outputs=so)))
    return reqs



_RUNS: dict[str, dict] = {}


def _run(key: str, target: str, tp: int, spec: dict | None, **engine) -> dict:
    """Every request of ``_requests`` through one engine: token ids, texts, finish reasons, stats."""
    if key not in _RUNS:
        reqs = _requests()
        with LLM(target, tensor_parallel_size=tp, speculative_config=spec, **ENGINE, **engine) as llm:
            outs = llm.generate([p for _, p, _ in reqs], [s for _, _, s in reqs], use_tqdm=False)
            stats = llm.get_stats()
            runner = getattr(llm.llm_engine.executor, "runner", None)
            grammars_left = None if runner is None else len(runner.grammars)
        _RUNS[key] = dict(
            ids=[o.outputs[0].token_ids for o in outs], texts=[o.outputs[0].text for o in outs],
            finish=[o.outputs[0].finish_reason for o in outs], stats=stats, grammars_left=grammars_left,
        )
    return _RUNS[key]


def _draft(model: str, flag: bool, probabilistic: bool = False) -> dict:
    return dict(method="draft_model", model=model, num_speculative_tokens=3, adaptive=False,
                use_local_argmax_reduction=flag, draft_sample_method="probabilistic" if probabilistic else "greedy")


# name: (target fixture, tp, speculative config with "model" naming a fixture, engine extras)
CASES = {
    "ngram-tp1": (1, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False), {}),
    "self-flag-tp1": (1, _draft("tiny_llama", True), {}),
    "qwen3-noflag-probabilistic-tp1": (1, _draft("tiny_qwen3", False, probabilistic=True), {}),
    "dflash-flag-tp1": (1, dict(method="dflash", model="tiny_dflash", num_speculative_tokens=4, adaptive=False,
                                use_local_argmax_reduction=True), {}),
    "self-flag-tp2-vocab-parallel": (2, _draft("tiny_llama", True), dict(sampling_mode="vocab-parallel")),
    "qwen3-flag-probabilistic-tp2-vocab-parallel": (2, _draft("tiny_qwen3", True, probabilistic=True),
                                                    dict(sampling_mode="vocab-parallel")),
    "dflash-noflag-tp2": (2, dict(method="dflash", model="tiny_dflash", num_speculative_tokens=4, adaptive=False,
                                  use_local_argmax_reduction=False), {}),
    "mtp-flag-tp2": (2, dict(method="mtp", model="tiny_mtp", num_speculative_tokens=3, adaptive=False,
                             use_local_argmax_reduction=True), {}),
}


@pytest.fixture(scope="module")
def tiny_mtp(tiny_llama, tmp_path_factory) -> str:
    """A random one-layer MTP module for the tiny Llama (EAGLE-3's chain runs through the same
    drafting loop; the real shipped EAGLE-3 head is in test_default_model.py)."""
    from tests.models.test_mtp import write_mtp

    return write_mtp(str(tmp_path_factory.mktemp("tiny-mtp")), tiny_llama, seed=4)


def _plain(tp: int, request, **engine) -> dict:
    key = f"plain-tp{tp}-" + "-".join(f"{k}={v}" for k, v in sorted(engine.items()))
    return _run(key, request.getfixturevalue("tiny_llama"), tp, None, **engine)


def test_plain_outputs_keep_their_constraints_at_tp1_and_tp2(request):
    one, two = _plain(1, request), _plain(2, request, sampling_mode="vocab-parallel")
    assert one["ids"] == two["ids"]  # greedy and seeded alike
    reqs = _requests()
    ended = [(p.structured_outputs, text) for (_, _, p), text, finish in zip(reqs, one["texts"], one["finish"]) if finish == "stop"]
    assert len(ended) >= len(reqs) * 3 // 4, one["finish"]
    for so, text in ended:
        assert_satisfies(so, text)
    assert one["grammars_left"] == 0  # every request's grammar went with it


@pytest.mark.parametrize("case", CASES)
def test_speculative_output_under_a_grammar_equals_plain_output(case, request):
    tp, spec, engine = CASES[case]
    if "model" in spec:
        spec = dict(spec, model=request.getfixturevalue(spec["model"]))
    got = _run(case, request.getfixturevalue("tiny_llama"), tp, spec, **engine)
    plain = _plain(1, request)
    reqs = _requests()
    greedy = [i for i, (_, _, p) in enumerate(reqs) if p.temperature == 0]
    assert [got["ids"][i] for i in greedy] == [plain["ids"][i] for i in greedy]
    for (_, _, p), text, finish in zip(reqs, got["texts"], got["finish"]):
        if finish == "stop":
            assert_satisfies(p.structured_outputs, text)
    assert got["stats"]["num_accepted_tokens"] > 0


def test_a_grammar_adds_no_communication(request):
    """Each rank masks its own columns: vocab-parallel sampling (every row sampled with top-k 50,
    EOS ignored, so both runs sample the same kinds of rows) moves the same bytes per row with and
    without a grammar, and flagged greedy drafting under a grammar still moves 8·tp bytes per row."""
    target = request.getfixturevalue("tiny_llama")
    per_row = []
    for so in (None, StructuredOutputsParams(json=SCHEMAS["nested"])):
        params = [SamplingParams(temperature=1.0, seed=i, top_k=50, max_tokens=24, ignore_eos=True, structured_outputs=so)
                  for i in range(len(PROMPTS))]
        with LLM(target, tensor_parallel_size=2, sampling_mode="vocab-parallel", **ENGINE) as llm:
            llm.generate(PROMPTS, params, use_tqdm=False)
            per_row.append(llm.get_stats()["comm_bytes_per_row"]["sample"])
    assert per_row[0] == per_row[1] > 0
    spec = dict(CASES["self-flag-tp2-vocab-parallel"][1], model=target)
    drafted = _run("self-flag-tp2-vocab-parallel", target, 2, spec, sampling_mode="vocab-parallel")
    assert drafted["stats"]["comm_bytes_per_row"]["draft.sample"] == 8 * 2


def test_grammar_state_ends_with_its_request_however_it_ends(request):
    """Finished, stopped by a stop string, aborted while running, aborted while waiting: each
    request's grammar leaves the rank (TP 1: the runner is in this process), over rounds."""
    from tpspec.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(model=request.getfixturevalue("tiny_llama"), max_num_seqs=2, **ENGINE)
    runner = engine.executor.runner
    so = StructuredOutputsParams(json=SCHEMAS["nested"])
    try:
        for round_ in range(3):
            ids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=round_ * 10 + i, max_tokens=MAX_TOKENS,
                                                        stop=['"'] if i == 1 else None, structured_outputs=so))
                   for i, p in enumerate(PROMPTS)]  # 4 requests, 2 running at a time
            engine.step()
            engine.step()
            assert len(runner.grammars) == 2
            engine.abort_request(ids[0])  # running
            engine.abort_request(ids[3])  # waiting (never scheduled)
            while engine.has_unfinished_requests():
                engine.step()
            engine.step()  # the ranks forget ended requests at the next step
            assert len(runner.grammars) == 0, round_
    finally:
        engine.shutdown()
