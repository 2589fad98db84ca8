"""Structured outputs on the real default model (SmolLM2-135M-Instruct, Q4_1), chat prompts: every
output of a suite of schemas (nested objects, arrays with item bounds, enums, string patterns,
nullable fields, number bounds), a regex and a choice list completes and validates, greedy and
sampled; the shipped EAGLE-3 head drafting under the grammar (its draft vocabulary mapped to the
target's ids), at TP 2 with the flag and at TP 1 without, gives the same greedy tokens as plain
decoding."""

from __future__ import annotations


import pytest

from tpspec import LLM, SamplingParams
from tpspec.sampling_params import StructuredOutputsParams
from tpspec.tokenizer import Tokenizer

from .outputs import assert_satisfies

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                                  "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                                "required": ["sku", "price"], "additionalProperties": False}},
            "note": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["id", "status", "items", "note"], "additionalProperties": False,
    },
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 4},
}
QUESTIONS = {
    "person": "Give me a JSON object for a person called Ada who is 36.",
    "order": "Write a JSON order with two items that has shipped.",
    "tags": "List three colours as a JSON array.",
    "regex": "What is a US phone number? Answer like 555-123-4567.",
    "choice": "Is the sky green? Answer yes or no.",
}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no"]


def _constraint(name: str) -> StructuredOutputsParams:
    if name in SCHEMAS:
        return StructuredOutputsParams(json=SCHEMAS[name])
    return StructuredOutputsParams(regex=REGEX) if name == "regex" else StructuredOutputsParams(choice=CHOICES)



@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tpspec.models.loader.resolve import resolve_model

    tok = Tokenizer.from_pretrained(resolve_model(None))
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                       add_special_tokens=False) for q in QUESTIONS.values()]


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=7, max_tokens=160, structured_outputs=_constraint(n))
            for n in QUESTIONS]


ENGINE = dict(num_kv_blocks=256)  # 4,096 tokens: a few prompts of up to 160 tokens' answers, not 1 GiB to zero
_PLAIN: dict[float, list] = {}


def _plain(prompts, temperature: float):
    if temperature not in _PLAIN:
        with LLM(**ENGINE) as llm:
            _PLAIN[temperature] = llm.generate(prompts, _params(temperature), use_tqdm=False)
    return _PLAIN[temperature]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_output_completes_and_validates(prompts, temperature):
    for name, out in zip(QUESTIONS, _plain(prompts, temperature)):
        assert out.outputs[0].finish_reason == "stop", (name, out.outputs[0].text)
        assert_satisfies(_constraint(name), out.outputs[0].text)


@pytest.mark.parametrize("tp,flag", [(2, True), (1, False)], ids=["tp2-flag", "tp1-noflag"])
def test_the_shipped_eagle3_head_drafts_under_the_grammar(prompts, tp, flag):
    """With the flag each shard masks its draft-vocabulary columns by their target ids; without,
    the gathered draft-vocabulary row is masked the same way (``Eagle3...greedy_tokens``)."""
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False, "use_local_argmax_reduction": flag}
    with LLM(tensor_parallel_size=tp, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate(prompts, _params(0.0), use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in _plain(prompts, 0.0)]
    assert stats["num_accepted_tokens"] > 0.3 * stats["num_draft_tokens"]  # drafts under the grammar are mostly taken
