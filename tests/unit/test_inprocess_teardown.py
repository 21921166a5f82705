"""The restartable wrapper's end of a round, where it broke on a GPU at a process's second in-process restart.

Seen in py-spy stacks of survivors under nccl (docs/benchmarks.md, "On a GPU", session 35): the interrupt
landed just after ``_leave`` took the lock, the lock stayed taken, and the next "abort" waited for it for
ever in the control thread.
"""

from __future__ import annotations

import threading

import pytest

from elaunch.inprocess import worker


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
