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
    """On a CPU at TP 1, an engine on a thread of its own (``AsyncEngine``, under ``tpspec serve``)
    times its phases (the controller's step-time model learns from them) in its thread's CPU time:
    while the caller's thread holds the GIL (the server's, streaming outputs), the step does not
    advance, and that wait must not be charged to the phase it fell in. Here the phase's own work
    runs on a thread while the main thread takes the GIL about half the time: wall time counts
    both, the phase time its own. On the main thread (``LLM``, offline) the clock is wall time."""
    runner = types.SimpleNamespace(device=torch.device("cpu"))

    def work(n: int) -> None:
        total = 0
        for i in range(n):
            total += i * i

    measured = {}

    def engine_thread() -> None:
        wall0, phase0 = time.perf_counter(), ModelRunner._now(runner)
        for _ in range(5):
            work(200_000)
        measured.update(phase=ModelRunner._now(runner) - phase0, wall=time.perf_counter() - wall0)

    engine = threading.Thread(target=engine_thread)
    engine.start()
    while engine.is_alive():  # the caller's thread, busy in Python
        work(1000)
    engine.join()
    assert measured["phase"] < 0.75 * measured["wall"]  # about half: the main thread held the GIL the rest
    t0 = ModelRunner._now(runner)
    time.sleep(0.05)
    assert ModelRunner._now(runner) - t0 >= 0.05  # offline: wall time
