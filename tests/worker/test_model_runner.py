"""The model runner on its own terms: a step's sampling metadata is built once (one gather from
the slot-indexed sampling states) and every drafting pass and verified position indexes it; the
rank's per-request state (records, sampling slots, drafts) goes with the request."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams
from tpspec.sample.sampler import SamplingMetadata
from tpspec.sample.sampling_states import SamplingStates
from tpspec.worker.model_runner import ModelRunner
from tests.models.test_eagle3 import write_eagle3

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory) -> str:
    return write_eagle3(str(tmp_path_factory.mktemp("eagle3-runner")), seed=4)


def test_sampling_metadata_is_built_once_per_step(tiny_llama, eagle3_head, monkeypatch):
    builds = {"gather": 0, "from_params": 0}
    per_step: list[tuple[int, int, int]] = []  # (drafts verified, gathers, from_params) per step
    gather, from_params, execute = SamplingStates.gather, SamplingMetadata.from_params.__func__, ModelRunner.execute

    def counting_gather(self, *args):
        builds["gather"] += 1
        return gather(self, *args)

    def counting_from_params(cls, *args, **kwargs):
        builds["from_params"] += 1
        return from_params(cls, *args, **kwargs)

    def counting_execute(self, step):
        builds.update(gather=0, from_params=0)
        out = execute(self, step)
        per_step.append((sum(s.num_spec for s in step.seqs), builds["gather"], builds["from_params"]))
        return out

    monkeypatch.setattr(SamplingStates, "gather", counting_gather)
    monkeypatch.setattr(SamplingMetadata, "from_params", classmethod(counting_from_params))
    monkeypatch.setattr(ModelRunner, "execute", counting_execute)
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3, "adaptive": False,
            "draft_sample_method": "probabilistic"}
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(tiny_llama, speculative_config=spec, num_kv_blocks=48, max_model_len=128) as llm:
        llm.generate(PROMPTS, params, use_tqdm=False)
        runner = llm.llm_engine.executor.runner
        assert len(runner.sampling_states) == len(runner.requests) == len(runner.speculator.states) == 0
    verifying = [s for s in per_step if s[0] > 0]
    assert len(verifying) >= 5 and all(s[0] == 3 * len(PROMPTS) for s in verifying[:1])
    assert all((gathers, built) == (1, 0) for _, gathers, built in per_step), per_step
