"""``SamplingStates``: parameters written once per request into slots; a step's metadata is one
gather, equal to building it from the parameters; slots are reused and grow on demand."""

from __future__ import annotations

import random

import numpy as np
import torch

from tpspec.sample.sampler import SamplingMetadata
from tpspec.sample.sampling_states import SamplingStates
from tpspec.sampling_params import SamplingParams


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7, 1e300]),  # 1e300: inf in float32, as from_params makes it top_k=rng.choice([0, 1, 5]), top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.1]), logprobs=rng.choice([None, 0, 3]),
    )


def _equal(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("max_num_logprobs", "all_greedy", "all_random", "no_top_k_top_p_min_p"):
        assert getattr(a, name) == getattr(b, name), name


def test_gather_equals_building_from_the_params():
    rng = random.Random(1)
    states = SamplingStates(num_slots=4)  # grows past 4
    requests = {}
    for step in range(40):
        for _ in range(rng.randint(0, 3)):
            req_id = f"r{step}-{rng.random()}"
            requests[req_id] = (_random_params(rng), rng.randint(-2**70, 2**70))  # any int seed
            states.add(req_id, *requests[req_id])
        for req_id in rng.sample(sorted(requests), k=min(len(requests), rng.randint(0, 2))):
            states.remove(req_id)
            del requests[req_id]
        if not requests:
            continue
        rows = [rng.choice(sorted(requests)) for _ in range(rng.randint(1, 10))]
        positions = [rng.randint(0, 500) for _ in rows]
        gathered = states.gather(np.array([states.slot_of[r] for r in rows]), torch.tensor(positions))
        built = SamplingMetadata.from_params([requests[r][0] for r in rows], [requests[r][1] for r in rows], positions)
        _equal(gathered, built)
    assert len(states) == len(requests)


def test_slots_are_reused_lowest_first():
    states = SamplingStates(num_slots=2)
    assert [states.add(r, SamplingParams(), 0) for r in "ab"] == [0, 1]
    states.remove("a")
    assert states.add("c", SamplingParams(), 0) == 0
    assert states.add("d", SamplingParams(), 0) == 2  # a third request past 2 slots: they doubled
    assert states.add("e", SamplingParams(), 0) == 3
    states.remove("unknown")  # a request the rank never saw: nothing happens
    assert len(states) == 4
