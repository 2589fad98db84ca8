"""Tensor parallelism across nodes, on loopback: every "node" other than the head is a separate
process tree (``tpspec serve --headless --node-rank 1``, in its own session) and meets the head
only through ``--master-addr/--master-port``.

TP 2 as 1 + 1 ranks and TP 4 as 2 + 2 give TP 1's greedy and seeded tokens, with the same
collectives as on one node, all counted as crossing nodes; DFlash with the flag on works across
nodes. A node that differs from the head (dtype, model, speculative config) is refused with the
field named, and both sides exit; a node that never comes, or a head that never comes, ends the
start with an error naming it. Killing the headless node's tree mid-stream ends the request with
an error and the head exits 1 within 15 s; a node that vanishes without closing its connections
(SIGSTOP) is found by the heartbeat; a head killed outright takes the node with it. Nothing is
left running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tpspec import LLM, SamplingParams
from tpspec.executor.node_link import HEARTBEAT_TIMEOUT_S, NodeStartError
from tpspec.distributed.parallel_state import get_state

from tests.server.utils import ServerProcess, metrics, open_stream, request

pytestmark = pytest.mark.serial  # runs alone (wall-clock bounds: see the serial marker in pyproject.toml)

ENGINE = dict(num_kv_blocks=64, max_model_len=128)
ENGINE_FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "128"]
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown", "import"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.5, seed=20 + i, top_p=0.95, max_tokens=16, ignore_eos=True) for i in range(3)]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _free_port_pair() -> int:
    """A port P with P + 1 also free (the head listens on P, the rendezvous takes P + 1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree(pid: int) -> list[int]:
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"processes {survivors} were left running"


class Node:
    """``tpspec serve --headless``: a node's process tree, in its own session (killpg reaches all of it)."""

    def __init__(self, model: str, tp: int, port: int, log_path, *extra: str, node_rank: int = 1, nnodes: int = 2):
        self.log_path = str(log_path)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tpspec", "serve", model, "--headless", "--tensor-parallel-size", str(tp),
                 "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-port", str(port),
                 *ENGINE_FLAGS, *extra],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **ONE_THREAD},
            )

    @property
    def log(self) -> str:
        return open(self.log_path).read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the node did not exit within {timeout} s:\n{self.log[-3000:]}")

    def kill_tree(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


_RUNS: dict[tuple, dict] = {}


def _generate(llm: LLM) -> dict:
    # Shared memory only joins ranks of one node; across nodes every collective goes through gloo.
    nnodes = llm.llm_engine.config.parallel.nnodes
    assert (get_state().shm is not None) == (nnodes == 1 and llm.llm_engine.config.parallel.tensor_parallel_size > 1)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]
    return dict(greedy=greedy, seeded=seeded, stats=llm.get_stats())


def _run(model: str, tp: int, nnodes: int, tmp_path=None, spec: dict | None = None) -> dict:
    """Greedy then seeded batches on a TP ``tp`` engine over ``nnodes`` nodes; memoized."""
    key = (model, tp, nnodes, json.dumps(spec))
    if key not in _RUNS:
        extra = dict(speculative_config=spec) if spec else {}
        if nnodes == 1:
            with LLM(model, tensor_parallel_size=tp, **ENGINE, **extra) as llm:
                _RUNS[key] = _generate(llm)
        else:
            port = _free_port_pair()
            flags = ["--speculative-config", json.dumps(spec)] if spec else []
            node = Node(model, tp, port, tmp_path / f"node-{tp}.log", *flags)
            try:
                with LLM(model, tensor_parallel_size=tp, nnodes=nnodes, master_port=port, **ENGINE, **extra) as llm:
                    local = [p.pid for p in llm.llm_engine.executor.workers]
                    assert len(local) == tp // nnodes - 1
                    remote = _tree(node.proc.pid)
                    assert len(remote) == 2 + tp // nnodes, remote  # the agent, its fork server and its ranks
                    _RUNS[key] = _generate(llm)
                assert node.wait(30) == 0, node.log[-3000:]  # the head's clean shutdown ends the node cleanly
                assert "the head shut the engine down" in node.log
            finally:
                node.kill_tree()
            _assert_gone(local + remote, timeout=5)
    return _RUNS[key]


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2-1+1", "tp4-2+2"])
def test_two_nodes_give_tp1_tokens_and_count_cross_node_traffic(tiny_llama, tp, tmp_path):
    ref, one_node, two_nodes = _run(tiny_llama, 1, 1), _run(tiny_llama, tp, 1), _run(tiny_llama, tp, 2, tmp_path)
    assert all(len(t) == 16 for t in ref["greedy"] + ref["seeded"])
    assert two_nodes["greedy"] == ref["greedy"]
    assert two_nodes["seeded"] == ref["seeded"]  # noise keyed by global token id, whatever node holds it
    assert ref["seeded"] != ref["greedy"]
    # The same collectives as on one node, in the same units; on two nodes every one crosses.
    comm1, comm2 = one_node["stats"]["comm"], two_nodes["stats"]["comm"]
    assert set(comm2) == set(comm1) and "layer.all_reduce" in comm2
    for site, c in comm2.items():
        assert (c["calls"], c["bytes"]) == (comm1[site]["calls"], comm1[site]["bytes"]), site
        assert c["cross_node_bytes"] == c["bytes"] > 0, site
        assert comm1[site]["cross_node_bytes"] == 0, site


def test_dflash_with_the_flag_across_nodes(tiny_llama, tiny_dflash, tmp_path):
    spec = dict(method="dflash", model=tiny_dflash, num_speculative_tokens=3, use_local_argmax_reduction=True,
                adaptive=False)  # a fixed k: an untrained drafter would be switched off
    plain, ref, got = _run(tiny_llama, 1, 1), _run(tiny_llama, 1, 1, spec=spec), _run(tiny_llama, 2, 2, tmp_path, spec)
    assert got["greedy"] == plain["greedy"]  # lossless across nodes
    assert got["seeded"] == ref["seeded"]  # the same speculative samples as one rank draws
    stats = got["stats"]
    assert stats["num_draft_tokens"] > 0
    # The flag's draft selection: one (value, id) float32 pair per rank and draft row, across nodes.
    assert stats["comm_bytes_per_row"]["draft.sample"] == 2 * 4 * 2
    assert stats["comm"]["draft.sample"]["cross_node_bytes"] == stats["comm"]["draft.sample"]["bytes"]


@pytest.mark.parametrize("case", ["dtype", "model", "speculative"])
def test_a_node_that_differs_is_refused_on_both_sides(tiny_llama, tiny_qwen3, tiny_dflash, case, tmp_path):
    spec = dict(method="ngram", num_speculative_tokens=3)
    node_model, node_flags, head_kw, field = {
        "dtype": (tiny_llama, ["--dtype", "bfloat16"], {}, "dtype"),
        "model": (tiny_qwen3, [], {}, "model"),
        "speculative": (tiny_llama, ["--speculative-config", json.dumps({**spec, "num_speculative_tokens": 4})],
                        dict(speculative_config=spec), "speculative.num_speculative_tokens"),
    }[case]
    port = _free_port_pair()
    before = set(_tree(os.getpid()))
    node = Node(node_model, 2, port, tmp_path / "node.log", *node_flags)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as error:
            LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port, dtype="float32", **ENGINE, **head_kw)
        assert time.monotonic() - t0 < 30
        message = str(error.value)
        assert "node 1" in message and f"{field}:" in message, message
        assert node.wait(30) == 2  # a configuration error, the same message
        assert f"{field}:" in node.log and "refused" in node.log, node.log[-3000:]
    finally:
        node.kill_tree()
    assert set(_tree(os.getpid())) - {node.proc.pid} <= before  # no worker was started here
    _assert_gone(_tree(node.proc.pid), timeout=5)


def _stray_request(port: int) -> None:
    """Something that is not a tpspec node dials the head's port and sends a JSON line that is no hello."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b'{"type": "ping"}\n')
                return
        except OSError:
            time.sleep(0.05)


def test_a_missing_node_or_head_ends_the_start_with_its_name(tiny_llama, tmp_path):
    port = _free_port_pair()
    stray = threading.Thread(target=_stray_request, args=(port,), daemon=True)
    stray.start()
    t0 = time.monotonic()
    # The stray connection is ignored: the start still ends on the missing node, by name.
    with pytest.raises(NodeStartError, match=r"node\(s\) 1 did not join within --distributed-timeout 2 s"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port, distributed_timeout=2, **ENGINE)
    assert time.monotonic() - t0 < 10
    stray.join(5)
    node = Node(tiny_llama, 2, port, tmp_path / "node.log", "--distributed-timeout", "2")
    try:
        assert node.wait(30) == 1
        assert f"could not reach the head at 127.0.0.1:{port} within --distributed-timeout 2 s" in node.log
    finally:
        node.kill_tree()


def test_a_slow_model_load_on_the_head_keeps_its_node(tiny_llama, tmp_path, monkeypatch):
    """The heartbeats run from the admission on: a head that takes longer than the heartbeat
    timeout to load its shard (a big model, a GGUF conversion) must not look dead to its nodes."""
    from tpspec.worker.model_runner import ModelRunner

    load = ModelRunner.load_model

    def slow_load(self):
        time.sleep(HEARTBEAT_TIMEOUT_S + 2)
        return load(self)

    monkeypatch.setattr(ModelRunner, "load_model", slow_load)
    port = _free_port_pair()
    node = Node(tiny_llama, 2, port, tmp_path / "node.log")
    try:
        with LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port, **ENGINE) as llm:
            assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == _run(tiny_llama, 1, 1)["greedy"][0]
        assert node.wait(30) == 0, node.log[-3000:]
    finally:
        node.kill_tree()


def test_bad_multi_node_options_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is not divisible by nnodes=2"):
        LLM(tiny_llama, tensor_parallel_size=3, nnodes=2, **ENGINE)
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes - 1\]"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, node_rank=2, **ENGINE)
    with pytest.raises(ValueError, match="the other nodes run `tpspec serve --headless`"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, node_rank=1, **ENGINE)
    with pytest.raises(ValueError, match="distributed_backend='nccl' needs CUDA devices"):
        LLM(tiny_llama, tensor_parallel_size=2, distributed_backend="nccl", device="cpu", **ENGINE)


def _serve_two_nodes(model: str, tmp_path) -> tuple[ServerProcess, Node]:
    port = _free_port_pair()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port), "--max-model-len", "512",
             "--num-kv-blocks", "160"]
    node = Node(model, 2, port, tmp_path / "node.log", "--max-model-len", "512", "--num-kv-blocks", "160")
    head = ServerProcess([model, "--served-model-name", "tiny", *flags], str(tmp_path / "head.log"), env=ONE_THREAD)
    head.wait_ready()
    return head, node


def _stream_first_event(head: ServerProcess):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    conn, resp = open_stream(head.url + "/v1/completions", body)
    assert resp.status == 200
    while not resp.readline().startswith(b"data: "):
        pass
    return conn, resp


def _assert_stream_ends_with_engine_dead(conn, resp) -> None:
    events = [line[6:].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == b"[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "engine_dead", events[-2]


@pytest.mark.parametrize("how", ["killed", "vanished"])
def test_losing_the_headless_node_mid_stream_stops_the_head(tiny_llama, how, tmp_path):
    """Killed: its connections close and the head knows at once. Vanished (SIGSTOP: a machine that
    is gone without closing anything): the heartbeat stops, and the head must not wait for the
    step stuck in a collective with it."""
    head, node = _serve_two_nodes(tiny_llama, tmp_path)
    node_pids = _tree(node.proc.pid)
    try:
        conn, resp = _stream_first_event(head)
        t0 = time.monotonic()
        os.killpg(node.proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        _assert_stream_ends_with_engine_dead(conn, resp)
        assert head.proc.wait(15) == 1
        seconds = time.monotonic() - t0
        assert seconds < (HEARTBEAT_TIMEOUT_S if how == "killed" else HEARTBEAT_TIMEOUT_S + 8), seconds
        log = open(head.log_path).read()
        reason = "closed the connection" if how == "killed" else f"no message from node 1 ({socket.gethostname()}"
        assert reason in log and "stopping the server" in log, log[-3000:]
        if how == "vanished":  # woken up, the node finds its head gone and stops its workers
            os.killpg(node.proc.pid, signal.SIGCONT)
            assert node.wait(30) == 1
    finally:
        head.stop()
        node.kill_tree()
    _assert_gone(node_pids, timeout=5)


def test_the_node_exits_when_the_head_is_killed(tiny_llama, tmp_path):
    head, node = _serve_two_nodes(tiny_llama, tmp_path)
    node_pids = _tree(node.proc.pid)
    try:
        assert request("POST", head.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})[0] == 200
        sample = metrics(head.url)
        site = (("site", "layer.all_reduce"),)
        assert sample[("tpspec:comm_cross_node_bytes_total", site)] == sample[("tpspec:comm_bytes_total", site)] > 0
        head.proc.kill()
        assert node.wait(15) == 1
        assert "127.0.0.1" in node.log and "stopping this node's workers" in node.log, node.log[-3000:]
    finally:
        head.stop()
        node.kill_tree()
    _assert_gone(node_pids, timeout=5)


def test_a_reset_connection_reads_as_the_peer_closing_it():
    """A killed node's socket is reset, not closed, when it had unread data: the head says the
    node closed the connection either way (the message the killed-node test reads)."""
    from tpspec.executor.node_link import Link, LinkClosed

    server = socket.create_server(("127.0.0.1", 0))
    b = socket.create_connection(server.getsockname())
    a, _ = server.accept()
    server.close()
    link = Link(a, "node 1 (vm, pid 7)")
    b.close()  # EOF
    with pytest.raises(LinkClosed, match=r"^node 1 \(vm, pid 7\) closed the connection$"):
        link.recv(1.0)

    class Resetting:
        def settimeout(self, t):
            pass

        def recv(self, n):
            raise ConnectionResetError(104, "Connection reset by peer")

        def sendall(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    link.sock = Resetting()
    with pytest.raises(LinkClosed, match=r"closed the connection \(Connection reset by peer\)"):
        link.recv(1.0)
    with pytest.raises(LinkClosed, match=r"closed the connection \(Broken pipe\)"):
        link.send("hb")
    a.close()
