import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tpspec.engine.detokenizer import IncrementalDetokenizer
from tpspec.sampling_params import SamplingParams

PIECES = ["the", " quick", " brown", " fox", "END", "EN", "D", "\n", "中", "文", "😀", "é", "ab", " ", "!"]


class Adapter:
    """The project's Tokenizer interface over a `tokenizers.Tokenizer`, recording window sizes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.max_window = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.max_window = max(self.max_window, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


@pytest.fixture(scope="module")
def raw_tok() -> Tokenizer:
    """A small byte-level BPE: rare multibyte characters stay split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. END of line\n\n"] * 20
    corpus += ["中文字符 héllo wörld café 😀 ok"] * 3
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture
def tok(raw_tok: Tokenizer) -> Adapter:
    return Adapter(raw_tok)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def stream(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed ids in random-sized chunks (one by one without rng); returns deltas incl. flush."""
    deltas, i = [], 0
    while i < len(ids) and det.finished_by_stop is None:
        step = rng.randint(1, 4) if rng else 1
        deltas.append(det.update(ids[i:i + step]))
        i += step
    deltas.append(det.flush())
    return deltas


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop string that completes first (longest on a tie), and the text it leaves."""
    matches = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, neg_len, stop = min(matches)
    return text[: end if include else end + neg_len], stop


def test_tokenizer_splits_multibyte_characters(tok):
    """Guards the other tests' premise: some tokens decode to partial characters."""
    assert any("\ufffd" in tok.decode([i], False) for i in tok.encode("中文 😀 é"))


@pytest.mark.parametrize("chunked", [False, True])
def test_deltas_concatenate_to_full_decode(tok, chunked):
    rng = random.Random(0)
    for _ in range(100):
        ids = tok.encode(random_text(rng, rng.randint(0, 30)))
        prompt = tok.encode(random_text(rng, rng.randint(0, 5)))
        det = IncrementalDetokenizer(tok, prompt, SamplingParams())
        deltas = stream(det, ids, rng if chunked else None)
        assert "".join(deltas) == tok.decode(ids, True) == det.output_text
        assert not any("\ufffd" in d for d in deltas), "a split character leaked as U+FFFD"
        assert det.num_output_tokens == len(ids)


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_ids_match_full_decode(tok, skip_special):
    """Arbitrary ids, invalid UTF-8 and special tokens included: the stream still equals decode."""
    rng = random.Random(1)
    vocab = tok.tok.get_vocab_size()
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        det = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip_special))
        assert "".join(stream(det, ids, rng)) == tok.decode(ids, skip_special)


def test_special_tokens_follow_skip_special_tokens(tok):
    eos = tok.tok.token_to_id("<eos>")
    ids = tok.encode("the fox") + [eos]
    det = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(det, ids)) == "the fox<eos>"
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert "".join(stream(det, ids)) == "the fox"


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("ok 中文😀 done")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i], False).endswith("\ufffd"))
    det = IncrementalDetokenizer(tok, ids[:cut], SamplingParams())
    full = tok.decode(ids, False)
    clean_prompt = tok.decode(ids[:cut], False).rstrip("\ufffd")
    assert "".join(stream(det, ids[cut:])) == full[len(clean_prompt):]


def test_work_per_token_is_bounded(tok):
    rng = random.Random(2)
    ids = tok.encode(random_text(rng, 3000))
    expected = tok.decode(ids, True)
    det = IncrementalDetokenizer(tok, tok.encode("a prompt of some length " * 20), SamplingParams(stop="zzz"))
    tok.max_window = 0
    assert "".join(stream(det, ids)) == expected
    assert 0 < tok.max_window <= 10, "decode windows must not grow with the output"


def test_stop_string_across_tokens_is_never_partially_emitted(tok):
    ids = tok.encode("the quick brown fox jumps")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="brown f"))
    deltas = [det.update([i]) for i in ids[:4]]
    assert det.finished_by_stop == "brown f"
    assert "".join(deltas) == det.output_text == "the quick "
    assert all("b" not in d for d in deltas), "part of the stop string was streamed"
    with pytest.raises(RuntimeError):
        det.update(ids[4:])
    assert det.flush() == ""


def test_include_stop_str_in_output(tok):
    ids = tok.encode("the quick brown fox jumps")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["brown f"], include_stop_str_in_output=True))
    assert "".join(stream(det, ids)) == det.output_text == "the quick brown f"
    assert det.finished_by_stop == "brown f"


def test_held_text_is_released_when_the_stop_does_not_complete(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="END!"))
    assert det.update(tok.encode("the END")) == "the "
    assert det.output_text == "the END"  # held back from the stream, but part of the text
    assert det.update(tok.encode(".")) == "END."
    assert det.finished_by_stop is None


def test_flush_releases_held_text(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="END"))
    assert det.update(tok.encode("the EN")) == "the "
    assert det.flush() == "EN"
    assert det.output_text == "the EN" and det.finished_by_stop is None
    with pytest.raises(RuntimeError):
        det.flush()


def test_tokens_after_the_stop_are_not_consumed(tok):
    ids = tok.encode("the fox!the quick")
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="!"))
    completing = next(i for i in range(len(ids)) if "!" in tok.decode(ids[: i + 1], True))
    det.update(ids)
    assert det.finished_by_stop == "!" and det.output_text == "the fox"
    assert det.num_output_tokens == completing + 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_reference(tok, include):
    """Random texts and stops: the output equals the reference and the stream never retracts."""
    rng = random.Random(3 + include)
    stopped = 0
    for _ in range(300):
        text = random_text(rng, rng.randint(1, 25))
        stops = [random_text(rng, rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]
        ids = tok.encode(text)
        det = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
        emitted = ""
        expected, expected_stop = reference_stop(tok.decode(ids, True), stops, include)
        for d in stream(det, ids, rng):
            emitted += d
            assert expected.startswith(emitted), "streamed text that the final output does not have"
        assert emitted == det.output_text == expected
        assert det.finished_by_stop == expected_stop
        stopped += expected_stop is not None
    assert 50 < stopped < 280, "the random cases should exercise both outcomes"


def test_first_completed_stop_wins_regardless_of_chunking(tok):
    ids = tok.encode("the quick brown fox")
    for chunk in (1, len(ids)):
        det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["quick brown", "ick"]))
        for i in range(0, len(ids), chunk):
            det.update(ids[i:i + chunk])
            if det.finished_by_stop:
                break
        assert det.finished_by_stop == "ick" and det.output_text == "the qu"


class BytePieces:
    """A decoder over explicit byte strings, to place a character split exactly."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_text_before_a_split_character_is_not_delayed():
    smile = "😀".encode()
    tok = BytePieces(b"ab" + smile[:2], smile[2:] + b"c", b"d")
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert det.update([0]) == "ab"
    assert det.update([1]) == "😀c"
    assert det.update([2]) + det.flush() == "d"

    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="b"))
    det.update([0, 1, 2])
    assert det.finished_by_stop == "b" and det.output_text == "a" and det.num_output_tokens == 1


def test_flush_shows_a_character_that_never_completed():
    tok = BytePieces(b"ok", "😀".encode()[:3])
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop="zz"))
    assert det.update([0, 1]) == "ok"
    assert det.flush() == "\ufffd" and det.output_text == "ok\ufffd"
