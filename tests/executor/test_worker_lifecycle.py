"""TP worker processes never outlive their engine and never hang it: a killed worker makes the
engine raise ``EngineDeadError`` within seconds, a worker that dies while starting fails the
start, and shutdown, garbage collection, an exception, Ctrl-C or SIGKILL of the driver leave no
worker process behind."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import tpspec.executor.executor as executor_mod
import tpspec.executor.local_workers as local_workers_mod
from tpspec import LLM, SamplingParams
from tpspec.executor.executor import EngineDeadError

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)

ENGINE = dict(tensor_parallel_size=2, num_kv_blocks=64, max_model_len=128)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:  # never leave them running for the rest of the session
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"worker processes {survivors} outlived their engine"


def _call(fn, timeout: float):
    """``fn()`` in a daemon thread: (result, exception, seconds); fails the test if it hangs."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"call still running after {timeout} s: the engine hangs")
    return box.get("result"), box.get("error"), time.monotonic() - t0


@contextlib.contextmanager
def _broadcasts():
    """The step messages rank 0 broadcasts to the workers meanwhile (kinds, in order)."""
    sent: list[str] = []
    broadcast = executor_mod.comm.broadcast_object

    def counting(obj, site):
        if obj is not None:
            sent.append(obj[0])
        return broadcast(obj, site)

    executor_mod.comm.broadcast_object = counting
    try:
        yield sent
    finally:
        executor_mod.comm.broadcast_object = broadcast


def _worker_pids(llm: LLM) -> list[int]:
    pids = [p.pid for p in llm.llm_engine.executor.workers]
    assert len(pids) == 1 and all(_alive(p) for p in pids)
    return pids


def _on_layer_call(llm: LLM, layer: int, call: int, action) -> None:
    """Run ``action()`` when rank 0 enters decoder layer ``layer`` for the ``call``-th time: in the
    middle of a step, between the layers' collectives."""
    model = llm.llm_engine.executor.runner.model
    model.use_layer_plans = False  # the layer's forward is what is wrapped: a plan calls the kernels without it
    module = model.layers[layer]
    forward, calls = module.forward, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            action()
        return forward(*args, **kwargs)

    module.forward = wrapped


@pytest.mark.parametrize("when", ["between-requests", "mid-step"])
def test_killed_worker_makes_the_engine_raise(tiny_llama, when):
    llm = LLM(tiny_llama, **ENGINE)
    pids = _worker_pids(llm)
    try:
        assert len(llm.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 8
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        if when == "between-requests":
            told = threading.Event()
            llm.llm_engine.on_worker_death(lambda reason: told.set())
            os.kill(pids[0], signal.SIGKILL)
            assert told.wait(10), "the watchdog did not report the death of an idle engine's worker"
        else:  # the worker dies while rank 0 is between two of a step's all-reduces
            _on_layer_call(llm, layer=1, call=5, action=lambda: os.kill(pids[0], signal.SIGKILL))
        with _broadcasts() as sent:
            _, error, _ = _call(lambda: llm.generate(["hello"] * 4, long, use_tqdm=False), timeout=30)
        assert isinstance(error, EngineDeadError), error
        if when == "between-requests":  # known before the call: the TP group is not touched again
            assert not sent, sent
        # Dead stays dead: the next call raises without touching the TP group (or hanging in it).
        with _broadcasts() as sent:
            _, error, _ = _call(lambda: llm.generate("again", PARAMS, use_tqdm=False), timeout=30)
        assert isinstance(error, EngineDeadError) and not sent, (error, sent)
    finally:
        _call(llm.shutdown, timeout=30)
    _assert_gone(pids, timeout=1)


def test_an_idle_engine_outlives_the_workers_timeout(tiny_llama):
    """Workers wait for the next step in a gloo broadcast that gives up after worker_timeout_s:
    an engine left idle for several times that (a server without requests) must still serve."""
    from tpspec.config import ParallelConfig
    from tpspec.engine.engine_args import EngineArgs
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.tokenizer import Tokenizer

    config = EngineArgs(model=tiny_llama, **ENGINE).create_engine_config("cpu")
    # The workers' start (spawn, import torch) must fit in the timeout too: 2 s failed on a busy host.
    config = dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=2, worker_timeout_s=5.0))
    engine = LLMEngine(config, Tokenizer.from_pretrained(config.model))
    try:
        time.sleep(12.0)  # more than two timeouts without a step
        engine.add_request("def add(a, b):", PARAMS)
        outputs, error, _ = _call(lambda: [o for _ in range(20) for o in engine.step()], timeout=30)
        assert error is None and engine.executor.dead is None
        assert any(o.finished and len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outputs)
    finally:
        engine.shutdown()


def test_shutdown_and_context_exit_stop_the_workers(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        pids = _worker_pids(llm)
        llm.generate("hello", PARAMS, use_tqdm=False)
    _assert_gone(pids, timeout=1)  # __exit__ waited for them
    llm.shutdown()  # a second shutdown is a no-op


def test_garbage_collected_llm_stops_the_workers(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE)
    pids = _worker_pids(llm)
    llm.generate("hello", PARAMS, use_tqdm=False)
    del llm
    gc.collect()
    _assert_gone(pids, timeout=15)


def _crashing_worker(rank, config, device_kind, init_method, environ, ready_fd) -> None:
    """A worker that exits before joining the TP group, having written its pid where the engine's
    environment says."""
    with open(environ["TPSPEC_TEST_CRASH_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    sys.exit(3)


def test_worker_dying_during_startup_fails_the_start(tiny_llama, monkeypatch, tmp_path):
    """A worker that exits before joining the TP group (bad device, import error, ...) must not
    leave rank 0 waiting for it until the rendezvous timeout (minutes)."""
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("TPSPEC_TEST_CRASH_PIDS", str(pids_file))
    monkeypatch.setattr(local_workers_mod, "_worker_main", _crashing_worker)
    _, error, seconds = _call(lambda: LLM(tiny_llama, **ENGINE), timeout=60)
    monkeypatch.undo()
    started = [int(line) for line in pids_file.read_text().split()]
    assert started and error is not None
    assert "exit code 3" in str(error), error
    assert seconds < 20
    _assert_gone(started, timeout=5)
    # The process can start a healthy TP engine afterwards.

    def healthy() -> int:
        with LLM(tiny_llama, **ENGINE) as llm:
            return len(llm.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids)

    assert _call(healthy, timeout=60)[:2] == (8, None)


def test_a_tp_engine_must_be_alone_in_its_process(tiny_llama):
    """The TP group and its counters are per process: a second engine beside a TP one would run
    its collectives on it (a TP 1 engine created next to it silently broke its output)."""
    ref = None
    with LLM(tiny_llama, **ENGINE) as llm:
        ref = llm.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        for tp in (1, 2):
            with pytest.raises(RuntimeError, match="tensor_parallel_size"):
                LLM(tiny_llama, tensor_parallel_size=tp, num_kv_blocks=64, max_model_len=128)
        assert llm.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref
    with LLM(tiny_llama, num_kv_blocks=64, max_model_len=128) as tp1:
        with pytest.raises(RuntimeError, match="tensor_parallel_size"):
            LLM(tiny_llama, **ENGINE)
        assert tp1.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref
        with LLM(tiny_llama, num_kv_blocks=64, max_model_len=128) as another_tp1:  # TP 1 engines coexist
            assert another_tp1.generate("hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_interrupted_step_leaves_the_engine_dead_not_desynchronized(tiny_llama):
    """Ctrl-C (KeyboardInterrupt) in rank 0 in the middle of a step, as in a notebook, where only
    the driver is interrupted: the workers are left inside the step's collectives, so going on
    would pair mismatched collectives (a hang, or wrong tokens). The engine must refuse instead,
    and still shut down promptly."""

    def interrupt():
        raise KeyboardInterrupt

    llm = LLM(tiny_llama, **ENGINE)
    pids = _worker_pids(llm)
    try:
        _on_layer_call(llm, layer=1, call=5, action=interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["import"] * 4, PARAMS, use_tqdm=False)
        stats = llm.get_stats()
        assert stats["num_running"] == stats["num_waiting"] == 0  # generate() ended its requests
        with _broadcasts() as sent:
            _, error, _ = _call(lambda: llm.generate("hello", PARAMS, use_tqdm=False), timeout=30)
        assert isinstance(error, EngineDeadError) and not sent, (error, sent)
    finally:
        try:
            _, _, seconds = _call(llm.shutdown, timeout=20)
            assert seconds < 5
        finally:
            _assert_gone(pids, timeout=1)


# No `if __name__ == "__main__"` guard: workers are forks of a fresh interpreter (the fork server),
# which never imports this.
_DRIVER = textwrap.dedent(
    """
    import signal
    import sys
    from tpspec import LLM, SamplingParams

    # Ctrl-C as in a terminal's foreground job, whatever this test inherited (a shell's
    # background job starts with SIGINT ignored, and Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64, max_model_len=128)
    print(" ".join(str(p.pid) for p in llm.llm_engine.executor.workers), flush=True)
    if sys.argv[2] == "exception":
        raise RuntimeError("driver failed")
    while True:  # busy in the engine when the signal comes
        llm.generate(["hello"] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    """
)


@pytest.mark.parametrize("how", ["exception", "ctrl-c", "sigkill"])
def test_driver_death_leaves_no_orphans(tiny_llama, tmp_path, how):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    # Its own session, so Ctrl-C can be sent to its process group as a terminal would.
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_llama, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip(), proc.communicate(timeout=30)[1][-3000:]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1
        try:
            pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:  # "exception" may have exited already
            pass
        if how == "ctrl-c":
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "sigkill":
            time.sleep(0.5)
            proc.kill()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0
        if how == "exception":
            assert "driver failed" in err
            # Shut down at exit, not in a __del__ during teardown that waits out timeouts and fails.
            assert "Exception ignored" not in err, err[-3000:]
            assert time.monotonic() - t0 < 8
        _assert_gone(pids, timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
