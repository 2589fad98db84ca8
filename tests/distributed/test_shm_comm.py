"""The shared-memory collectives (``distributed/shm_comm.py``): two ranks as two threads of this
process, each with its own mapping of one segment."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tpspec.distributed import shm_comm
from tpspec.distributed.shm_comm import ShmCommunicator

pytestmark = pytest.mark.skipif(not shm_comm.shm_available(), reason="no /dev/shm")


@pytest.fixture
def pair():
    name = ShmCommunicator.new_name()
    ranks = [ShmCommunicator(0, 2, name, True, 1 << 16, timeout_s=30.0)]
    ranks.append(ShmCommunicator(1, 2, name, False, 1 << 16, timeout_s=30.0))
    ranks[0].unlink()
    yield ranks
    for r in ranks:
        r.close()


def _on_both(ranks, fn):
    """fn(rank's communicator, rank) on two threads at once -> their results, rank order."""
    out = [None, None]

    def run(r):
        out[r] = fn(ranks[r], r)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_all_reduce_and_all_gather_give_every_rank_the_same_bits(pair):
    torch.manual_seed(0)
    xs = [torch.randn(3, 5) for _ in range(2)]
    reduced = _on_both(pair, lambda c, r: c.all_reduce_(xs[r].clone()).clone())
    assert torch.equal(reduced[0], reduced[1]) and torch.equal(reduced[0], xs[0] + xs[1])
    gathered = _on_both(pair, lambda c, r: c.all_gather(xs[r]).clone())
    assert torch.equal(gathered[0], gathered[1]) and torch.equal(gathered[0], torch.cat(xs))


@pytest.fixture
def busy_core(monkeypatch):
    """Every yield hands the core away for 2 ms, as beside two busy threads on a slow CPU."""
    monkeypatch.setattr(shm_comm.os, "sched_yield", lambda: time.sleep(0.002))


def test_a_lost_peer_ends_the_wait_promptly_on_a_busy_core(pair, busy_core):
    rank0 = pair[0]
    threading.Timer(0.05, lambda: setattr(rank0, "abort_reason", "TP worker rank 1 died")).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="TP peer lost: TP worker rank 1 died"):
        rank0.all_reduce_(torch.ones(4))  # rank 1 never comes
    assert time.monotonic() - start < 1.0


def test_a_peer_that_never_comes_times_out_on_a_busy_core(pair, busy_core):
    rank0 = pair[0]
    rank0.timeout_s = 0.2
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not reach the collective within 0.2 s"):
        rank0.all_gather(torch.ones(4))
    assert time.monotonic() - start < 1.5
