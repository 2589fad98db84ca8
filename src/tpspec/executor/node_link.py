"""The link between the head of a multi-node engine and each other node: one TCP connection per
node, on the head's ``master_addr:master_port``, carrying JSON messages (one per line; nothing
is unpickled from the network).

Start-up (before any rank joins the TP group):

    node → head   {"type": "hello", "node_rank": r, "host": ..., "pid": ..., "fingerprint": {...}}
    head → node   {"type": "accept", "init_method": "tcp://ADDR:PORT"}   or   {"type": "refuse", "error": ...}
    node → head   {"type": "ready"}         its workers are about to join the TP group

The head waits ``distributed_timeout_s`` for every node's hello, refuses every node if one
differs from it (``fingerprint``) or is missing, and names it. From the accept on, both ends
send a heartbeat (``{"type": "hb"}``) every ``HEARTBEAT_INTERVAL_S``, while the ranks load the
model too; once the engine runs, a node whose rank dies says so
(``{"type": "dead", "reason": ...}``), and a head that shuts down cleanly says
``{"type": "shutdown"}``. A closed connection, or no message for ``HEARTBEAT_TIMEOUT_S`` (a
machine that vanished without closing its sockets), is the other end's death.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from tpspec.config import DEFAULT_MASTER_PORT, ParallelConfig
from tpspec.executor.fingerprint import mismatches

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
_MAX_MESSAGE_BYTES = 1 << 20
_RETRY_S = 0.2  # between a node's connection attempts while the head is not up yet


class LinkClosed(ConnectionError):
    """The other end closed the link, sent something that is not a message, or fell silent."""


class NodeStartError(RuntimeError):
    """A node did not join, or left, while the engine started."""


def master_port(parallel: ParallelConfig) -> int:
    return DEFAULT_MASTER_PORT if parallel.master_port is None else parallel.master_port


def rendezvous_method(parallel: ParallelConfig) -> str:
    """The torch.distributed rendezvous of a multi-node group: the head's ``master_port + 1``."""
    return f"tcp://{parallel.master_addr}:{master_port(parallel) + 1}"


class Link:
    """One end of a node link."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.sock = sock
        self.peer = peer  # for messages: "node 1 (host, pid 123)" or "the head at ADDR:PORT"
        self._buf = b""
        self._send_lock = threading.Lock()
        self._stop = threading.Event()

    def send(self, kind: str, **fields) -> None:
        data = json.dumps({"type": kind, **fields}).encode() + b"\n"
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as e:
            raise LinkClosed(self._closed(e)) from e

    def _closed(self, e: OSError) -> str:
        """What a socket error says: a peer whose process died resets the connection when it had
        unread data (ECONNRESET) instead of closing it (EOF); both are the peer closing it."""
        if isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return f"{self.peer} closed the connection ({e.strerror or e})"
        return f"{self.peer}: {e}"

    def recv(self, timeout_s: float) -> dict:
        """The next message; ``LinkClosed`` when the connection ends, ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from {self.peer} for {timeout_s:.0f} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                raise LinkClosed(self._closed(e)) from e
            if not chunk:
                raise LinkClosed(f"{self.peer} closed the connection")
            self._buf += chunk
            if len(self._buf) > _MAX_MESSAGE_BYTES:
                raise LinkClosed(f"{self.peer} sent a message over {_MAX_MESSAGE_BYTES} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise LinkClosed(f"{self.peer} sent something that is not a node-link message: {line[:80]!r}")
        return msg

    def recv_skipping_heartbeats(self, timeout_s: float) -> dict:
        while True:
            msg = self.recv(timeout_s)
            if msg["type"] != "hb":
                return msg

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._beat, name="tpspec-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.send("hb")
            except LinkClosed:  # the receiving side sees the death
                return

    def watch(self, on_message: Callable[[dict], None], on_lost: Callable[[str], None]) -> None:
        """On a thread: ``on_message`` for every message but heartbeats; ``on_lost(reason)`` once when
        the link ends (not after ``close``)."""

        def run() -> None:
            while True:
                try:
                    msg = self.recv_skipping_heartbeats(HEARTBEAT_TIMEOUT_S)
                except (LinkClosed, TimeoutError) as e:
                    if not self._stop.is_set():
                        on_lost(str(e))
                    return
                on_message(msg)

        threading.Thread(target=run, name="tpspec-node-link", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class HeadLinks:
    """The head's links, one per other node, admitted after comparing fingerprints."""

    def __init__(self, parallel: ParallelConfig, fingerprint: dict[str, str]) -> None:
        self.parallel = parallel
        self.fingerprint = fingerprint
        self.address = f"{parallel.master_addr}:{master_port(parallel)}"
        self.links: dict[int, Link] = {}  # node rank → link
        try:
            self._server = socket.create_server((parallel.master_addr, master_port(parallel)), backlog=64)
        except OSError as e:
            raise NodeStartError(
                f"the head cannot listen on --master-addr/--master-port {self.address}: {e} (the address must "
                "be one of this machine's, and the port and the next one free)"
            ) from e

    def admit(self) -> None:
        """Wait for every other node's hello; accept them all with the rendezvous address, or
        refuse them all and raise (``ValueError`` for a node that differs, ``NodeStartError`` for
        one missing)."""
        wanted = set(range(1, self.parallel.nnodes))
        deadline = time.monotonic() + self.parallel.distributed_timeout_s
        logger.info("waiting for node(s) %s on %s (--distributed-timeout %.0f s)",
                    ", ".join(map(str, sorted(wanted))), self.address, self.parallel.distributed_timeout_s)
        try:
            while wanted - set(self.links):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(map(str, sorted(wanted - set(self.links))))
                    raise NodeStartError(
                        f"node(s) {missing} did not join within --distributed-timeout "
                        f"{self.parallel.distributed_timeout_s:g} s (the head listens on {self.address})"
                    )
                self._server.settimeout(left)
                try:
                    sock, addr = self._server.accept()
                except socket.timeout:
                    continue
                self._hello(Link(sock, f"a node at {addr[0]}"), wanted, deadline)
            for link in self.links.values():
                link.send("accept", init_method=rendezvous_method(self.parallel))
                link.start_heartbeat()  # from now on: a node must not take a long model load for a death
        except BaseException as e:
            for link in self.links.values():
                try:
                    link.send("refuse", error=f"the head refused the start: {e}")
                except LinkClosed:
                    pass
            self.close(shutdown=False)
            raise
        finally:
            self._server.close()

    def _hello(self, link: Link, wanted: set[int], deadline: float) -> None:
        try:
            msg = link.recv(max(0.1, min(10.0, deadline - time.monotonic())))
        except (LinkClosed, TimeoutError) as e:
            msg = {"type": f"nothing ({e})"}
        if msg["type"] != "hello" or not isinstance(msg.get("fingerprint"), dict):  # not a tpspec node
            logger.warning("ignoring a connection from %s that sent %s instead of a hello", link.peer, msg["type"])
            link.close()
            return
        node = msg.get("node_rank")
        link.peer = f"node {node} ({msg.get('host')}, pid {msg.get('pid')})"
        problem = None
        if node not in wanted:
            problem = (f"{link.peer}: --node-rank must be in [1, {self.parallel.nnodes - 1}] for --nnodes "
                       f"{self.parallel.nnodes}, got {node}")
        elif node in self.links:
            problem = f"{link.peer}: node rank {node} joined twice (the first is {self.links[node].peer})"
        else:
            diff = mismatches(self.fingerprint, msg["fingerprint"])
            if diff:
                problem = f"{link.peer} does not match the head: " + "; ".join(diff)
        if problem is not None:
            try:
                link.send("refuse", error=problem)
            except LinkClosed:
                pass
            link.close()
            raise ValueError(problem)
        self.links[node] = link
        logger.info("%s joined", link.peer)

    def wait_ready(self, check_local: Callable[[], None]) -> None:
        """Wait until every node's workers are about to join the TP group; ``check_local()`` is
        called in between (it raises when a local worker died)."""
        deadline = time.monotonic() + self.parallel.distributed_timeout_s
        for node, link in self.links.items():
            while True:
                check_local()
                if time.monotonic() > deadline:
                    raise NodeStartError(f"{link.peer} did not start its workers within --distributed-timeout "
                                         f"{self.parallel.distributed_timeout_s:g} s")
                try:
                    msg = link.recv_skipping_heartbeats(0.1)
                except TimeoutError:
                    continue
                except LinkClosed as e:
                    raise NodeStartError(f"node {node} left during start-up: {e}") from e
                if msg["type"] == "ready":
                    break
                if msg["type"] == "dead":
                    raise NodeStartError(f"{link.peer}: {msg.get('reason')}")

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """``on_lost(reason)`` when a node dies, falls silent or reports a dead rank."""
        for link in self.links.values():
            def on_message(msg: dict, link: Link = link) -> None:
                if msg["type"] == "dead":
                    on_lost(f"{link.peer}: {msg.get('reason')}")

            link.watch(on_message, on_lost)  # the reason names the node

    def close(self, shutdown: bool) -> None:
        """Close every link; ``shutdown``: tell the nodes first that this is a clean stop."""
        for link in self.links.values():
            if shutdown:
                try:
                    link.send("shutdown")
                except LinkClosed:
                    pass
            link.close()
        self.links = {}


def join_head(parallel: ParallelConfig, fingerprint: dict[str, str]) -> tuple[Link, str]:
    """A node's side of the start-up: connect to the head (retrying until it listens, up to
    ``distributed_timeout_s``), say hello; returns the link and the rendezvous address. A refusal
    is a ``ValueError`` with the head's reason."""
    address = (parallel.master_addr, master_port(parallel))
    peer = f"the head at {address[0]}:{address[1]}"
    deadline = time.monotonic() + parallel.distributed_timeout_s
    logger.info("node %d: joining %s", parallel.node_rank, peer)
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise NodeStartError(f"could not reach {peer} within --distributed-timeout "
                                     f"{parallel.distributed_timeout_s:g} s: {e}") from e
            time.sleep(_RETRY_S)
    link = Link(sock, peer)
    try:
        link.send("hello", node_rank=parallel.node_rank, host=socket.gethostname(), pid=os.getpid(),
                  fingerprint=fingerprint)
        msg = link.recv_skipping_heartbeats(max(1.0, deadline - time.monotonic()))
    except (LinkClosed, TimeoutError) as e:
        link.close()
        raise NodeStartError(f"node {parallel.node_rank}: no answer from {peer}: {e}") from e
    if msg["type"] == "refuse":
        link.close()
        raise ValueError(f"{peer} refused node {parallel.node_rank}: {msg.get('error')}")
    if msg["type"] != "accept" or not isinstance(msg.get("init_method"), str):
        link.close()
        raise NodeStartError(f"{peer} answered {msg['type']!r} instead of accepting node {parallel.node_rank}")
    link.start_heartbeat()
    return link, msg["init_method"]
