"""``Request.token_ids_between`` is ``all_token_ids[start:end]`` for every range (the ranks read a
step's tokens through it)."""

from tpspec.engine.sequence import Request
from tpspec.sampling_params import SamplingParams


def test_token_ids_between_is_a_slice_of_all_tokens():
    req = Request("r", [1, 2, 3, 4], SamplingParams(), 0, 16, frozenset())
    req.output_token_ids += [5, 6, 7]
    all_ids = req.all_token_ids
    for start in range(len(all_ids) + 1):
        for end in range(start, len(all_ids) + 2):
            assert req.token_ids_between(start, end) == all_ids[start:end], (start, end)
