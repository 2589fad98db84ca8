"""One request's grammar on a rank (``structured.request_grammar``) and the compiler behind it
(``structured.grammar``), on the tiny Llama's byte-level tokenizer: masks follow the committed
output, drafting is tentative (``settle`` leaves the matcher where it was), drafts stop at the
first token the grammar forbids, and rejected constraints are ``GrammarError`` naming the field."""

from __future__ import annotations

import os

import pytest
import torch

from tpspec.config import ModelArchConfig
from tpspec.sample.token_bitmask import allowed, words_for
from tpspec.sampling_params import StructuredOutputsParams
from tpspec.structured.grammar import GrammarError, grammar_compiler
from tpspec.structured.request_grammar import RequestGrammar, is_allowed
from tpspec.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    arch = ModelArchConfig.from_folder(tiny_llama)
    compiler = grammar_compiler(os.path.join(tiny_llama, "tokenizer.json"), arch.vocab_size, [2])
    return compiler, Tokenizer.from_pretrained(tiny_llama), arch.vocab_size


def _grammar(setup, **constraint) -> RequestGrammar:
    compiler, _, vocab = setup
    return RequestGrammar(compiler.matcher(StructuredOutputsParams(**constraint)), words_for(vocab), [2])


def _allowed_ids(mask: torch.Tensor, vocab: int) -> list[int]:
    return torch.nonzero(allowed(mask.unsqueeze(0), torch.arange(vocab))[0]).squeeze(-1).tolist()


def _text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_masks_follow_the_committed_output(setup):
    _, tok, vocab = setup
    g = _grammar(setup, choice=["yes", "no"])
    first = _allowed_ids(g.verify_masks(0)[0], vocab)
    assert first and all(_text(tok, [t]) and ("yes".startswith(_text(tok, [t])) or "no".startswith(_text(tok, [t])))
                         for t in first)
    g.accept(tok.encode("n", add_special_tokens=False))
    assert {_text(tok, [t]) for t in _allowed_ids(g.verify_masks(0)[0], vocab)} == {"o"}
    g.accept(tok.encode("o", add_special_tokens=False))
    assert _allowed_ids(g.verify_masks(0)[0], vocab) == [2]  # complete: only EOS
    with pytest.raises(RuntimeError, match="rejected"):
        _grammar(setup, choice=["yes", "no"]).accept(tok.encode("x", add_special_tokens=False))


def test_drafts_are_tentative_and_stop_at_the_first_forbidden_token(setup):
    _, tok, vocab = setup
    g = _grammar(setup, json=SCHEMA)
    good = tok.encode('{"ok": true}', add_special_tokens=False)
    bad = tok.encode('{"no', add_special_tokens=False)
    fresh = [m.clone() for m in _masks_along(setup, good)]
    assert g.settle(good + [5, 6]) == len(good)  # after the object only EOS may follow
    held = g.verify_masks(len(good))
    assert torch.equal(held, torch.stack(fresh))  # the masks of each draft position, and after the last
    assert torch.equal(g.verify_masks(0)[0], fresh[0])
    assert _grammar(setup, json=SCHEMA).settle(bad) < len(bad)
    # settle rolled the matcher back: committing the drafts works, then the grammar is complete.
    g.accept(good)
    assert _allowed_ids(g.verify_masks(0)[0], vocab) == [2]


def _masks_along(setup, ids: list[int]) -> list[torch.Tensor]:
    """The mask before each of ``ids`` and after the last, by committing one token at a time."""
    g = _grammar(setup, json=SCHEMA)
    masks = []
    for t in ids:
        masks.append(g.verify_masks(0)[0])
        g.accept([t])
    return masks + [g.verify_masks(0)[0]]


def test_settle_reuses_what_the_drafter_consumed_and_rolls_back_what_it_dropped(setup):
    _, tok, _ = setup
    good = tok.encode('{"ok": false}', add_special_tokens=False)
    g = _grammar(setup, json=SCHEMA)
    for t in good:  # a chain drafter: each draft under its mask, consumed tentatively
        assert is_allowed(g.draft_mask(), t) and g.draft(t)
    assert g.settle(good[:3]) == 3  # the drafter kept 3 (e.g. max_model_len cut the chain)
    assert torch.equal(g.verify_masks(3), torch.stack(_masks_along(setup, good)[:4]))
    g.accept(good)  # the matcher was back at the committed output
    assert not g.draft(5)  # complete: a draft after the object is refused, and nothing is consumed


@pytest.mark.parametrize("constraint,field,message", [
    (dict(json={"type": "strin"}), "json", "strin"),
    (dict(regex="[a-"), "regex", "Unclosed"),
    (dict(grammar="root ::= undefined_rule"), "grammar", "undefined_rule"),
])
def test_rejected_constraints_name_their_field(setup, constraint, field, message):
    compiler, _, _ = setup
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutputsParams(**constraint))
    assert e.value.field == field and message in str(e.value) and str(e.value).startswith(f"structured_outputs.{field}: ")
    assert "/project/" not in str(e.value)  # xgrammar's source location is dropped


def test_every_kind_compiles_and_choice_strings_are_taken_literally(setup):
    compiler, tok, vocab = setup
    for constraint in (dict(json=SCHEMA), dict(json_object=True), dict(regex=r"[0-9]+"), dict(grammar='root ::= "a" "b"*')):
        assert compiler.matcher(StructuredOutputsParams(**constraint)) is not None
    tricky = 'say "hi"\\n\nü'
    g = _grammar(setup, choice=[tricky])
    ids = tok.encode(tricky, add_special_tokens=False)
    assert g.settle(ids) == len(ids)
    g.accept(ids)
    assert _allowed_ids(g.verify_masks(0)[0], vocab) == [2]
