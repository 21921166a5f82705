"""elaunch.procs.deferral: a handled signal's exception waits for the end of a deferred block (real signals)."""

from __future__ import annotations

import os
import signal

import pytest

from elaunch.procs.deferral import deferred, raise_or_defer


class Handled(Exception):
    pass


@pytest.fixture
def raising_usr1():
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: raise_or_defer(Handled(signum)))
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_outside_a_block_the_handler_raises_at_once(raising_usr1):
    reached = []
    with pytest.raises(Handled):
        os.kill(os.getpid(), signal.SIGUSR1)
        reached.append(True)
    assert reached == []


def test_inside_a_block_the_rest_of_it_runs_then_the_signal_raises(raising_usr1):
    reached = []
    with pytest.raises(Handled):
        with deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            reached.append("after the signal")
    assert reached == ["after the signal"]


def test_nested_blocks_raise_once_at_the_outermost_end(raising_usr1):
    reached = []
    with pytest.raises(Handled):
        with deferred():
            with deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
            reached.append("inner block ended")
    assert reached == ["inner block ended"]
    with deferred():  # nothing is left held
        pass


def test_the_signal_wins_over_the_blocks_own_error_which_it_carries(raising_usr1):
    with pytest.raises(Handled) as info:
        with deferred():
            os.kill(os.getpid(), signal.SIGUSR1)
            raise OSError("the fork failed")
    assert isinstance(info.value.__context__, OSError)

