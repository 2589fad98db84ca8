import dataclasses
import math

import pytest

from tpspec.sampling_params import MIN_TEMPERATURE, SamplingParams


def test_defaults_are_normalised():
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.stop == () and p.stop_token_ids == ()
    assert p.max_tokens == 16 and p.logprobs is None and not p.is_greedy


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_greedy_and_int_temperature():
    p = SamplingParams(temperature=0)
    assert p.is_greedy and isinstance(p.temperature, float)
    assert not SamplingParams(temperature=2).is_greedy


def test_tiny_temperature_is_raised():
    assert SamplingParams(temperature=1e-6).temperature == MIN_TEMPERATURE


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 0]).stop_token_ids == (3, 0)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_any_int_seed_is_accepted():
    assert SamplingParams(seed=2**80).seed == 2**80
    assert SamplingParams(seed=-3).seed == -3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # would overflow the int64 tensor and kill the engine step
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_names_value_and_allowed_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_from_dict_roundtrip():
    p = SamplingParams.from_dict({"temperature": 0.7, "top_k": 40, "stop": "\n\n", "seed": 7})
    assert p == SamplingParams(temperature=0.7, top_k=40, stop=("\n\n",), seed=7)


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match=r"\['beam', 'best_of'\]"):
        SamplingParams.from_dict({"temperature": 1.0, "best_of": 2, "beam": True})


def test_from_dict_requires_a_mapping():
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
