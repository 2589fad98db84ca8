"""The model runner on its own terms: a step's sampling metadata is built once (one gather from
the slot-indexed sampling states) and every drafting pass and verified position indexes it; the
rank's per-request state (records, sampling slots, drafts) goes with the request; its phase times
leave out waits for the GIL."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

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


def test_phase_times_leave_out_waits_for_the_gil():
    """On a CPU at TP 1 the runner's phase times (the controller's step-time model learns from them)
    are the engine thread's CPU time: while another thread of the process holds the GIL (the
    server's, streaming outputs), the step does not advance, and that wait must not be charged to
    the phase it fell in. Here the phase's own work runs beside a thread that takes the GIL about
    half the time: wall time counts both, the phase time its own."""
    runner = types.SimpleNamespace(device=torch.device("cpu"))

    def work(n: int) -> None:
        total = 0
        for i in range(n):
            total += i * i

    stop = threading.Event()
    other = threading.Thread(target=lambda: [work(1000) for _ in iter(stop.is_set, True)])
    wall0, phase0 = time.perf_counter(), ModelRunner._now(runner)
    other.start()
    for _ in range(5):
        work(200_000)
    phase, wall = ModelRunner._now(runner) - phase0, time.perf_counter() - wall0
    stop.set()
    other.join()
    assert phase < 0.75 * wall  # about half: the other thread held the GIL the rest of the time
