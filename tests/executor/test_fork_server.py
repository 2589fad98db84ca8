"""The fork server (executor/fork_server.py): a fork runs its target with the requester's path,
stdout, stderr and descriptors, and its requester learns its exit code whichever way it ends;
the server outlives the thread that started it and takes its forks with it when it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tpspec.executor.fork_server import fork_server


def _return() -> None:
    pass


def _exit(code: int) -> None:
    sys.exit(code)


def _fail() -> None:
    raise RuntimeError("the target failed")


def _say(text: str) -> None:
    print(text, flush=True)
    print(text.upper(), file=sys.stderr, flush=True)


def _sleep() -> None:
    time.sleep(600)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize(("target", "args", "code"), [(_return, (), 0), (_exit, (3,), 3), (_fail, (), 1)])
def test_the_requester_learns_the_exit_code(target, args, code, capfd):
    proc = fork_server().start(target, args)
    assert proc.wait(30) == code
    assert proc.exitcode == code  # read once, kept
    proc.close()
    assert proc.exitcode == code
    if target is _fail:
        assert "RuntimeError: the target failed" in capfd.readouterr().err


def test_a_descriptor_reaches_the_fork():
    r, w = os.pipe()
    try:
        proc = fork_server().start(_write_to_last, ("through the pipe",), fds=(w,))
    finally:
        os.close(w)
    with os.fdopen(r) as f:
        assert f.read() == "through the pipe"
    assert proc.wait(30) == 0


def _write_to_last(text: str, fd: int) -> None:
    os.write(fd, text.encode())


def test_output_goes_to_the_requesters_stdout_and_stderr(capfd):
    proc = fork_server().start(_say, ("hello from the fork",))
    assert proc.wait(30) == 0
    out, err = capfd.readouterr()
    assert "hello from the fork" in out and "HELLO FROM THE FORK" in err


def test_a_killed_fork_reports_the_signal():
    proc = fork_server().start(_sleep, ())
    assert proc.exitcode is None and proc.wait(0.2) is None
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()  # reaped: not sent to whatever has its pid now
    proc.close()


def test_the_server_outlives_the_thread_that_started_it_and_its_forks_die_with_it():
    earlier = fork_server()
    earlier.proc.kill()
    earlier.proc.wait()
    box = []

    def request() -> None:  # starts a new server, as a request's thread would, and uses it
        box.append(fork_server())
        assert box[0].start(_return, ()).wait(30) == 0  # the server serves: its death signal is armed

    t = threading.Thread(target=request)
    t.start()
    t.join()
    server = box[0]
    assert server is not earlier
    time.sleep(0.2)
    assert server.alive() and fork_server() is server
    proc = server.start(_sleep, ())
    assert proc.exitcode is None
    server.proc.kill()  # the server dies: its fork dies with it, and the requester is told
    assert _gone(proc.pid, timeout=10)
    assert proc.wait(30) is not None
    assert not server.alive() and fork_server() is not server  # a new one on the next request


def test_the_server_ends_before_the_process_that_started_it():
    """At interpreter exit the server is stopped and waited for (after the engines' own shutdown):
    once the process is gone, nothing it started is left, not even for a moment."""
    script = "from tpspec.executor.fork_server import fork_server; print(fork_server().proc.pid, flush=True)"
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        server_pid = int(proc.stdout)
        assert _gone(server_pid, timeout=0), server_pid
