"""elaunch.procs.deferral: a handled signal's exception waits for the end of a deferred block (real signals)."""

from __future__ import annotations

import os
import signal

import pytest

from elaunch.procs.deferral import deferred, from_signal, raise_or_defer


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


def test_what_a_signal_raised_is_told_apart_from_an_ordinary_error(raising_usr1):
    with pytest.raises(Handled) as info:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert from_signal(info.value)
    assert not from_signal(Handled(signal.SIGUSR1)) and not from_signal(OSError("ordinary"))


def test_a_signal_landing_in_an_event_write_stops_the_agent_and_the_event_is_kept(tmp_path):
    """The agent's real handlers (SIGTERM -> SignalException); SIGTERM arrives while an event is written
    (inside its echo to --event-log-handler): the exception leaves ``emit``, as it would anywhere else.
    Before, the event log's ``except Exception`` for a failing user handler took it for one and dropped it,
    and the agent went on (a SIGTERMed agent kept its rendezvous and its spares)."""
    from elaunch.agent.agent import SignalException
    from elaunch.agent.events import AgentEvents
    from elaunch.launch import _SignalHandlers

    echoed = []

    def echo(line: bytes) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this function returns
        echoed.append(line)

    events = AgentEvents(str(tmp_path / "events.jsonl"), "node", "host", 3, echo=echo)
    with _SignalHandlers(("SIGTERM",)):
        with pytest.raises(SignalException):
            events.emit("rendezvous_join")
        events.emit("after")  # the echo was not dropped as a failing handler (it runs, and is not signalled again)
    assert echoed and b'"after"' in echoed[-1]
    assert (tmp_path / "events.jsonl").read_text().count('"kind"') == 2
