"""The restartable wrapper's end of a round, where it broke on a GPU at a process's second in-process restart.

Two ways, both seen in py-spy stacks of survivors under nccl (docs/benchmarks.md, "On a GPU", session 35):
- the interrupt landed just after ``_leave`` took the lock, the lock stayed taken, and the next "abort"
  waited for it for ever in the control thread;
- the round's objects were let go while NCCL's watchdog thread still ran: ``~ProcessGroupNCCL`` joined it
  with the GIL held.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from elaunch.inprocess import worker
from elaunch.inprocess.channel import Channel
from elaunch.inprocess.wire import CONTROL_ENV
from tests.conftest import wait_for

PR_SET_NAME = 15


def _name_this_thread(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0) == 0


class _LandsAfterAcquire:
    """A re-entrant lock whose next acquire, once armed, raises a real ``RoundAborted`` in the taking thread
    just after the lock was taken (``PyThreadState_SetAsyncExc``, landing at the interpreter's next check),
    as the control thread's interrupt did on the GPU."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.armed = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got and self.armed:
            self.armed = False
            worker._async_raise(threading.get_ident(), worker.RoundAborted)
        return got

    __enter__ = acquire

    def release(self) -> None:
        self._lock.release()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()


def _control_with(lock: _LandsAfterAcquire) -> worker._Control:
    import socket
    a, b = socket.socketpair()
    b.close()
    control = worker._Control(a)
    control._lock = threading.Condition(lock)
    return control


def test_an_interrupt_landing_just_after_the_lock_is_taken_does_not_keep_the_lock():
    lock = _LandsAfterAcquire()
    control = _control_with(lock)
    control._state = worker.ABORTING  # the control thread interrupted this round and let go of the lock
    lock.armed = True
    try:
        assert control._leave() is True
    except worker.RoundAborted:  # tolerated only where it lands before the lock (then _round absorbs it)
        pytest.fail("the interrupt escaped _leave after the lock was taken")
    assert not lock.armed  # it did land
    assert control._state == worker.LEFT
    taken = []
    other = threading.Thread(target=lambda: taken.append(control._lock.acquire(timeout=5)))
    other.start()
    other.join(10)
    assert taken == [True], "the lock stayed with the thread that ran main(): the next abort would wait for ever"
    control._sock.close()


def test_await_watchdogs_waits_for_the_rounds_watchdog_threads_only():
    """Real OS threads named as torch names NCCL's watchdogs: one from before the round is not waited for;
    the round's is, until it ends; one that does not end is given up on after the timeout."""
    old_go, new_go = threading.Event(), threading.Event()
    named = threading.Barrier(2)

    def watchdog(go: threading.Event) -> None:
        _name_this_thread(worker.WATCHDOG_THREAD)
        named.wait()
        go.wait(30)

    old = threading.Thread(target=watchdog, args=(old_go,))
    old.start()
    named.wait()
    try:
        before = worker._nccl_watchdogs()
        assert len(before) == 1
        assert worker._await_watchdogs(before, timeout=5) < 1  # nothing of this round to wait for
        named.reset()
        new = threading.Thread(target=watchdog, args=(new_go,))
        new.start()
        named.wait()
        assert len(worker._nccl_watchdogs() - before) == 1
        threading.Timer(0.3, new_go.set).start()
        waited = worker._await_watchdogs(before, timeout=10)
        assert 0.25 <= waited < 10
        assert not new.is_alive() or not (worker._nccl_watchdogs() - before)
        new.join(10)
        named.reset()
        stuck_go = threading.Event()
        stuck = threading.Thread(target=watchdog, args=(stuck_go,))
        stuck.start()
        named.wait()
        assert worker._await_watchdogs(before, timeout=0.3) >= 0.3  # gives up
        stuck_go.set()
        stuck.join(10)
    finally:
        old_go.set()
        new_go.set()
        old.join(10)


@pytest.fixture
def channel():
    ch = Channel("test/teardown").open()
    yield ch
    ch.close()


@pytest.mark.parametrize("how", ["raises", "aborted", "raises_when_aborted"])
def test_the_rounds_objects_are_let_go_only_after_its_watchdog_ended(channel, tmp_path, how):
    """main() ends while a thread named as NCCL's watchdog still runs (it ends 0.5 s later, as an aborted
    group's watchdog does once it may); an object in main()'s frame records, when it is freed, whether
    that thread was still alive. main() ends by raising (a collective failed), by the agent's "abort"
    landing in it, or by raising its own error once the abort landed (a wrapper's ``except`` around a
    collective): the round then counts as aborted, and its own exception still holds the frame. The wrapper
    says "ready" and is handed a second round, which returns."""
    seen = tmp_path / "seen"
    blocked = tmp_path / "blocked"
    script = textwrap.dedent(f"""
        import ctypes, json, sys, threading, time
        import elaunch
        from elaunch.inprocess import worker

        calls = []
        done = threading.Event()

        def watchdog():
            ctypes.CDLL(None).prctl(15, worker.WATCHDOG_THREAD.encode(), 0, 0, 0)
            done.wait(30)
            time.sleep(0.5)

        class Round:
            def __init__(self, thread):
                self.thread = thread
            def __del__(self):
                with open({str(seen)!r}, "w") as f:
                    json.dump({{"watchdog_alive_when_freed": self.thread.is_alive()}}, f)

        @elaunch.restartable
        def main():
            calls.append(1)
            if len(calls) == 2:
                return "second round"
            thread = threading.Thread(target=watchdog)
            thread.start()
            round_objects = Round(thread)
            if {how!r} == "raises":
                done.set()
                raise RuntimeError("a collective failed")
            try:
                open({str(blocked)!r}, "w").close()
                time.sleep(60)  # the agent's abort lands here
            finally:
                done.set()
                if {how!r} == "raises_when_aborted":
                    raise RuntimeError("the collective failed: its connection was shut")

        print(main(), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, CONTROL_ENV: channel.address})
    try:
        channel.expect([proc.pid])
        got: list = []
        if how != "raises":
            wait_for(blocked.exists, 20, what="main() in its first round")
            wait_for(lambda: got.extend(m["op"] for _, m, _ in channel.take()) or "hello" in got, 20,
                     what="the worker's hello")
            assert channel.send(proc.pid, {"op": "abort"})
        wait_for(lambda: got.extend(m["op"] for _, m, _ in channel.take()) or "ready" in got, 20,
                 what="the worker's ready")
        assert got == (["hello", "raised", "ready"] if how == "raises" else ["hello", "ready"])
        env = {**os.environ, CONTROL_ENV: channel.address}
        assert channel.send(proc.pid, {"op": "go", "env": env, "stdout": None, "stderr": None})
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert out.strip() == "second round"
        assert json.loads(seen.read_text()) == {"watchdog_alive_when_freed": False}
    finally:
        proc.kill()
        proc.wait()
