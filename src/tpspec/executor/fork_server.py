"""A fork server: a process, started once per process that starts TP workers, that has imported
the workers' modules (and so torch) and forks a worker on request.

A fresh interpreter takes ~1.7 s to import torch; a fork of the server starts at once. The server
is itself a fresh interpreter (``python -m tpspec.executor.fork_server``), so neither it nor its
forks ever import the user's main module (a script without an ``if __name__ == "__main__"``
guard works), and it never runs a torch operation: no thread pool or CUDA context is forked.
A fork runs ``target(*args, *fds)`` with the requester's stdout and stderr, and ``fds`` (file
descriptors the requester passed) as numbers of its own. It dies with the server, and the
server with the process that started it (PR_SET_PDEATHSIG; started by a thread of its own, so not
with a short-lived thread of that process); the server reaps its forks and sends each one's exit
status to its requester (``ForkedProcess``).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable

_PRELOAD = "tpspec.executor.local_workers"  # what every worker imports: torch, the model runner, ...
_INT = struct.Struct("<i")
_MAX_FDS = 16


def die_with_parent() -> None:
    """Be killed when the parent exits (Linux; elsewhere a no-op). Call ``os.getppid()`` before
    and after: if it changed, the parent died before the signal was armed."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass


class ForkedProcess:
    """A fork of the server, as its requester sees it."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self.sentinel = status_fd  # readable once the process exited (its status sent, or the server gone)
        self._code: int | None = None
        self._lock = threading.Lock()  # the status is read once, whichever thread asks first

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: the signal that killed it); None while it runs. 255 if the
        server went away without telling."""
        with self._lock:
            if self._code is None and self.sentinel >= 0 and select.select([self.sentinel], [], [], 0)[0]:
                data = os.read(self.sentinel, _INT.size)
                self._code = _INT.unpack(data)[0] if len(data) == _INT.size else 255
            return self._code

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the process exited, or None after ``timeout`` seconds."""
        try:
            select.select([self.sentinel], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile (``close``): the code was read first
            pass
        return self.exitcode

    def kill(self) -> None:
        if self.exitcode is None:  # not reaped yet: the pid is still this process's
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Wait for the process to exit, then release its status pipe (the exit code stays readable)."""
        self.wait()
        with self._lock:
            fd, self.sentinel = self.sentinel, -1
        if fd >= 0:
            os.close(fd)


class ForkServer:
    """The requester's side: the server process and the connection forks are requested on."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tpspec.executor.fork_server", str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.sock = ours
        self.owner = os.getpid()
        self._lock = threading.Lock()

    def start(self, target: Callable, args: tuple, fds: tuple[int, ...] = ()) -> ForkedProcess:
        """Fork a process that runs ``target(*args, *fds)``; ``target`` and ``args`` are pickled
        (``target`` by reference)."""
        # The requester's sys.path first, on which the fork then finds ``target``'s module.
        payload = pickle.dumps(sys.path) + pickle.dumps((target, args))
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                socket.send_fds(self.sock, [_INT.pack(len(payload))], [status_w, 1, 2, *fds])
                self.sock.sendall(payload)
                pid = _INT.unpack(_recv_exactly(self.sock, _INT.size))[0]
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return ForkedProcess(pid, status_r)

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the server: it exits at the end of its connection (and its forks with it)."""
        self.sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


@atexit.register  # registered on import, before the executor's shutdown of live engines: runs after it
def _close_at_exit() -> None:
    """The server ends with this process, not a moment after it (nothing is left behind)."""
    if _SERVER is not None and _SERVER.owner == os.getpid():
        _SERVER.close()


def fork_server() -> ForkServer:
    """This process's fork server, started on first use (again if it died)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive():
            _SERVER = _start_on_a_thread_of_its_own()
        return _SERVER


def _start_on_a_thread_of_its_own() -> ForkServer:
    """A new server, started by a thread that lives as long as it does: the death signal follows
    the thread that started a process, and the thread that wants a worker first may be short-lived
    (a request's thread) while later engines in this process use the same server."""
    started: list[ForkServer | BaseException] = []
    ready = threading.Event()

    def keeper() -> None:
        try:
            started.append(ForkServer())
        except BaseException as e:  # handed to the caller
            started.append(e)
            return
        finally:
            ready.set()
        started[0].proc.wait()

    threading.Thread(target=keeper, name="tpspec-fork-server", daemon=True).start()
    ready.wait()
    if isinstance(started[0], BaseException):
        raise started[0]
    return started[0]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the fork server closed its connection")
        data += chunk
    return data


def _run_fork(sock: socket.socket, wakeup: tuple[int, int], payload: bytes, fds: list[int], server: int) -> None:
    """In a fork of the server (pid ``server``): become the requested process."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (*wakeup, fds[0]):
            os.close(fd)
        os.dup2(fds[1], 1)
        os.dup2(fds[2], 2)
        os.close(fds[1])
        os.close(fds[2])
        die_with_parent()
        # The server exited before the death signal was armed. Its pid is read before the fork: a
        # parent read here, after a kill, could already be the process that adopted this one.
        if os.getppid() != server:
            os._exit(1)
        stream = io.BytesIO(payload)
        sys.path[:] = pickle.load(stream)
        target, args = pickle.load(stream)
        target(*args, *fds[3:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(sock: socket.socket) -> None:
    importlib.import_module(_PRELOAD)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    status_fds: dict[int, int] = {}  # pid -> the write end of its requester's status pipe
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
            while status_fds:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                fd = status_fds.pop(pid, None)
                if fd is not None:
                    try:
                        os.write(fd, _INT.pack(os.waitstatus_to_exitcode(status)))
                    except BrokenPipeError:  # its requester stopped listening: nobody to tell
                        pass
                    os.close(fd)
        if sock in readable:
            header, fds, _, _ = socket.recv_fds(sock, _INT.size, _MAX_FDS)
            if not header:  # the requester is gone
                return
            if len(header) < _INT.size:
                header += _recv_exactly(sock, _INT.size - len(header))
            payload = _recv_exactly(sock, _INT.unpack(header)[0])
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                _run_fork(sock, (wake_r, wake_w), payload, fds, server)
            status_fds[pid] = fds[0]
            for fd in fds[1:]:
                os.close(fd)
            sock.sendall(_INT.pack(pid))


if __name__ == "__main__":
    die_with_parent()
    if os.getppid() != int(sys.argv[2]):  # the requester died before the death signal was armed
        sys.exit(1)
    # Ctrl-C in a terminal reaches the whole process group: the requester handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(socket.socket(fileno=int(sys.argv[1])))
