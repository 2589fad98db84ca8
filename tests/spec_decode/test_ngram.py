import random
import time

import numpy as np
import pytest

from tpspec.spec_decode.ngram import NgramProposer

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Brute force: for n = hi..lo, the latest start s < len - n with tokens[s:s+n] == suffix."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_finds_the_latest_match_and_proposes_what_followed():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6]
    # "5 6" occurs at 0 and 5; the latest is 5, followed by 7 3 4.
    assert p.propose(tokens) == [7, 3, 4]
    # A longer match wins over a more recent shorter one.
    tokens = [1, 5, 6, 8, 8, 0, 5, 6, 9, 9, 1, 5, 6]
    assert p.propose(tokens) == [8, 8, 0]  # 3-gram "1 5 6" at 0, though "5 6" recurs at 6
    assert NgramProposer(1, 2, 3).propose(tokens) == [9, 9, 1]  # max 2: the latest "5 6"


def test_respects_k_min_max_and_the_end_of_the_sequence():
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert NgramProposer(1, 3, 2).propose(tokens) == [4, 5]
    assert NgramProposer(1, 3, 10).propose(tokens) == [4, 5, 1, 2, 3]  # cut at the end, not padded
    assert NgramProposer(4, 5, 3).propose(tokens) == []  # only a 3-gram matches
    assert NgramProposer(3, 3, 1).propose(tokens) == [4]
    # Overlapping occurrences count: "7 7" matched by the 2-gram starting one earlier.
    assert NgramProposer(2, 2, 4).propose([7, 7, 7]) == [7]
    assert NgramProposer(1, 1, 2).propose([3, 8, 8]) == [8]


def test_returns_empty_when_nothing_matches():
    p = NgramProposer(1, 4, 5)
    assert p.propose([]) == []
    assert p.propose([1]) == []
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(2, 4, 5).propose([1, 2, 3, 2]) == []  # 1-gram "2" matches, min is 2


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        assert NgramProposer(lo, hi, k).propose(tokens) == reference(tokens, lo, hi, k), (tokens, lo, hi, k)
        assert NgramProposer(lo, hi, k).propose(np.array(tokens, dtype=np.int64)) == reference(tokens, lo, hi, k)


def test_fast_on_long_sequences():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 8000).tolist()  # many 1-gram candidates
    p = NgramProposer(1, 5, 8)
    start = time.perf_counter()
    for _ in range(20):
        p.propose(tokens)
    assert (time.perf_counter() - start) / 20 < 0.02


@pytest.mark.parametrize("args", [(0, 2, 3), (3, 2, 3), (1, 2, 0), (1.0, 2, 3), (True, 2, 3)])
def test_bad_config_raises(args):
    with pytest.raises(ValueError, match="prompt_lookup|num_speculative_tokens"):
        NgramProposer(*args)
