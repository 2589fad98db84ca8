"""AsyncEngine against a fake engine: one engine thread does every engine call, outputs stream to
asyncio, bad input and engine death reach the caller, leaving early aborts, idle does not spin."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tpspec.executor.executor import EngineDeadError
from tpspec.engine.async_engine import AsyncEngine
from tpspec.sampling_params import SamplingParams

from .fakes import FakeEngine


@pytest.fixture
def fake_engine():
    fake = FakeEngine()
    created_on = []

    def factory():
        created_on.append(threading.get_ident())
        return fake

    engine = AsyncEngine(factory)
    yield engine, fake, created_on
    engine.shutdown()


async def _collect(engine, prompt, **kw):
    return [out async for out in engine.generate(prompt, SamplingParams(**kw))]


async def _eventually(predicate, timeout: float = 30.0) -> None:
    """Wait for state, not for time: a loaded machine only makes this slower."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the engine never got there"
        await asyncio.sleep(0.01)


def _settled(read, timeout: float = 30.0, quiet_s: float = 0.2):
    """``read()`` once it has not changed for ``quiet_s``; fails if it keeps changing."""
    deadline = time.monotonic() + timeout
    value = read()
    while True:
        time.sleep(quiet_s)
        now = read()
        if now == value:
            return value
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {value} -> {now}"
        value = now


def test_streams_outputs_and_every_engine_call_is_on_the_engine_thread(fake_engine):
    engine, fake, created_on = fake_engine

    async def main():
        return await asyncio.gather(*(_collect(engine, [1, 2, 3], max_tokens=n) for n in (2, 5, 3)))

    results = asyncio.run(main())
    for outs, n in zip(results, (2, 5, 3)):
        assert len(outs) == n and [o.finished for o in outs] == [False] * (n - 1) + [True]
        assert "".join(o.new_text for o in outs) == outs[-1].outputs[0].text
        assert outs[-1].outputs[0].finish_reason == "length"
    # Created and stepped on the same long-lived thread, never the caller's.
    assert fake.threads == {created_on[0]} and created_on[0] != threading.get_ident()
    assert engine.engine is fake and engine.is_healthy


def test_bad_input_raises_value_error_and_engine_keeps_serving(fake_engine):
    engine, fake, _ = fake_engine

    async def main():
        with pytest.raises(ValueError, match="prompt is bad"):
            await _collect(engine, "bad")
        return await _collect(engine, [1], max_tokens=2)

    assert len(asyncio.run(main())) == 2
    assert engine._streams == {}  # nothing left behind by the rejected request


def test_leaving_the_stream_early_aborts_the_request(fake_engine):
    engine, fake, _ = fake_engine

    async def main():
        agen = engine.generate([1], SamplingParams(max_tokens=1000), request_id="early")
        async for out in agen:
            break
        await agen.aclose()
        await _eventually(lambda: "early" in fake.aborted)

    asyncio.run(main())
    assert fake.aborted == ["early"] and fake.requests == {}
    assert engine._streams == {}


def test_cancelling_a_waiting_consumer_aborts_the_request(fake_engine):
    engine, fake, _ = fake_engine
    fake.hold.set()  # the request runs but produces nothing: its consumer waits

    async def consume():
        async for _ in engine.generate([1], SamplingParams(max_tokens=1000), request_id="waiting"):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await _eventually(lambda: "waiting" in fake.requests)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _eventually(lambda: fake.aborted)

    asyncio.run(main())
    assert fake.aborted == ["waiting"] and fake.requests == {}


def test_abort_from_elsewhere_ends_the_stream_with_abort(fake_engine):
    engine, fake, _ = fake_engine
    fake.hold.set()

    async def main():
        stream = await engine.add_request([1], SamplingParams(max_tokens=1000), "x")
        engine.abort("x")
        return [out async for out in stream]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


def test_idle_engine_blocks_instead_of_spinning(fake_engine):
    engine, fake, _ = fake_engine
    asyncio.run(_collect(engine, [1], max_tokens=2))
    # Blocked on the queue, not polling: its calls stop (however long the thread takes to get
    # there on a busy machine), and stay stopped.
    polls = _settled(lambda: (fake.stats["num_steps"], fake.num_has_unfinished_calls))
    time.sleep(0.3)
    assert (fake.stats["num_steps"], fake.num_has_unfinished_calls) == polls
    assert asyncio.run(engine.get_stats())["num_steps"] == polls[0]  # and wakes up for work


def test_engine_death_fails_in_flight_requests_and_marks_unhealthy(fake_engine):
    engine, fake, _ = fake_engine
    fake.hold.set()

    async def main():
        stream = await engine.add_request([1], SamplingParams(max_tokens=1000), "inflight")
        stats = await engine.get_stats()
        fake.die.set()
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in stream:
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await _collect(engine, [1])
        assert await engine.get_stats() == stats  # the last snapshot, not a hang

    asyncio.run(main())
    engine._thread.join(5)
    assert not engine._thread.is_alive() and fake.shut_down
    with pytest.raises(EngineDeadError):
        engine.check_health()



def test_worker_death_while_idle_ends_the_engine_without_a_request(fake_engine):
    """The engine thread sleeps on its queue while idle: a worker's death must wake it, not wait
    for the next request to find out."""
    engine, fake, _ = fake_engine
    asyncio.run(_collect(engine, [1], max_tokens=2))
    assert engine.is_healthy and fake.death_listeners
    steps = fake.stats["num_steps"]
    fake.kill_worker()
    assert engine.join(timeout=10), "the engine thread is still waiting for work"
    assert not engine.is_healthy and fake.shut_down
    assert fake.stats["num_steps"] == steps  # no step was needed to notice
    with pytest.raises(EngineDeadError, match="died"):
        engine.check_health()

def test_shutdown_stops_the_thread_and_fails_in_flight_requests():
    fake = FakeEngine()
    fake.hold.set()
    engine = AsyncEngine(lambda: fake)

    async def main():
        stream = await engine.add_request([1], SamplingParams(max_tokens=1000), "r")
        threading.Timer(0.05, engine.shutdown).start()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(main())
    engine._thread.join(5)
    assert fake.shut_down and not engine.is_healthy


def test_engine_creation_error_propagates():
    def factory():
        raise ValueError("max_model_len too large")

    with pytest.raises(ValueError, match="max_model_len too large"):
        AsyncEngine(factory)
