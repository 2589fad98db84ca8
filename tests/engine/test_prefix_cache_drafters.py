"""Prefix caching with the shipped drafters on the real default model (SmolLM2-135M-Instruct,
Q4_1): a hit leaves the EAGLE-3 head and the DFlash drafter as able to draft as a cold start. A
prompt sent twice accepts the same drafts the second time (its blocks cached with the drafter's
KV), and a chat's next turn, which resends the first answer (blocks the drafter fed during
decoding, the last of them at the request's end), gives the same tokens and the same acceptance
as an engine without the cache."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.models.loader.resolve import resolve_model
from tpspec.tokenizer import Tokenizer

SYSTEM = ("You are a careful Python assistant. Answer with short, correct code and one sentence of "
          "explanation. Prefer the standard library, name things clearly, and never invent APIs.")
QUESTION = "Write a function that returns the squares of a list of numbers."
FOLLOW_UP = "Now make it skip negative numbers."
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ENGINE = dict(max_model_len=512, block_size=16, num_kv_blocks=256)


def _chat(tok: Tokenizer, turns: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(turns, add_generation_prompt=True), add_special_tokens=False)


def _run(method: str, caching: bool) -> dict:
    """The question twice, then the follow-up with the first answer in its history: tokens and
    accepted drafts per request."""
    tok = Tokenizer.from_pretrained(resolve_model(None))
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    first = _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    tokens, accepted = [], []
    with LLM(speculative_config=spec, enable_prefix_caching=caching, **ENGINE) as llm:
        prompts = [first, first]
        for i in range(3):
            if i == 2:
                answer = tok.decode(tokens[0])
                prompts.append(_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": answer},
                                           {"role": "user", "content": FOLLOW_UP}]))
            before = llm.get_stats()["num_accepted_tokens"]
            tokens.append(llm.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
            accepted.append(llm.get_stats()["num_accepted_tokens"] - before)
        stats = llm.get_stats()
    return dict(tokens=tokens, accepted=accepted, hits=stats["prefix_cache_hits"], prompts=prompts)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_hit_drafts_as_well_as_a_cold_start(method):
    on, off = _run(method, True), _run(method, False)
    assert on["tokens"] == off["tokens"]
    assert on["accepted"] == off["accepted"]
    assert on["accepted"][0] > 10  # the shipped drafters do draft here
    assert on["accepted"][1] == on["accepted"][0]  # the repeat, with its prompt's full blocks cached
    bs = ENGINE["block_size"]
    first, follow_up = on["prompts"][0], on["prompts"][2]
    history = first + on["tokens"][0]  # all but its last token computed
    shared = next((i for i, (a, b) in enumerate(zip(history, follow_up)) if a != b), len(history))  # where they part
    assert shared > len(first) + 16  # the answer re-tokenizes as generated, in part at least
    # The repeat takes its prompt's full blocks; the follow-up the full blocks it shares with the
    # first exchange (one fewer when EAGLE-3's block identity needs the token after the block).
    assert on["hits"] >= (len(first) - 1) // bs * bs + min(shared, len(history) - 1) // bs * bs - bs, (on["hits"], shared)
