"""What a waiting node says (issue 9 item 4): the line as a table, and its pacing."""

from __future__ import annotations

import io
import logging

import pytest

from elaunch.rendezvous.dynamic import wait_report
from elaunch.rendezvous.dynamic.wait_report import WaitReporter, describe_wait
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

S = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=4)
NOW = 1000.0


def st(**kw) -> RendezvousState:
    return RendezvousState(**kw)


@pytest.mark.parametrize("state, expected", [
    (st(participants={"me": -1}),
     "waiting for nodes: 1/4 joined (min 2, max 4), 1 more needed to start; gives up in 60 s"),
    (st(participants={"me": -1, "b": -1}, deadline=NOW + 0.8),
     "waiting for nodes: 2/4 joined (min 2, max 4), round closes in 0.8 s"),
    (st(participants={"me": -1, "b": -1, "c": -1}),
     "waiting for nodes: 3/4 joined (min 2, max 4)"),
    (st(round=3, complete=True, participants={"a": 0, "b": 1}, wait_list={"me"}),
     "waiting for the running round 3 (2 node(s)) to re-form with this node (min 2, max 4); gives up in 60 s"),
    (st(round=3, complete=True, participants={"a": 0, "b": 1, "c": 2, "d": 3}, redundancy_list={"me"}),
     "waiting as a spare: round 3 is running at max_nodes=4 (min 2, max 4); joining when a node leaves"),
    (st(round=3, complete=True, participants={"me": 0, "b": 1}), None),  # joined: nothing to say
    (st(closed=True, participants={"me": -1}), None),
])
def test_describe_wait(state, expected):
    assert describe_wait(state, S, "me", NOW, NOW + 60) == expected


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def info_logged():
    logger = logging.getLogger("elaunch.rendezvous")
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


def test_log_lines_are_paced_and_quiet_at_first(info_logged, caplog):
    clock, waiting = Clock(), st(participants={"me": -1})
    r = WaitReporter(S, "me", stream=io.StringIO(), clock=clock)
    r.start()
    with caplog.at_level(logging.INFO, logger="elaunch.rendezvous"):
        for t in (0.5, 1.9, wait_report.QUIET_FOR, 3.0, 6.9, wait_report.QUIET_FOR + wait_report.LOG_EVERY):
            clock.t = t
            r.update(waiting, NOW, NOW + 60)
        r.finish()
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == ["waiting for nodes: 1/4 joined (min 2, max 4), 1 more needed to start; gives up in 60 s "
                     "(waited 2 s)",
                     "waiting for nodes: 1/4 joined (min 2, max 4), 1 more needed to start; gives up in 60 s "
                     "(waited 7 s)"]


def test_a_terminal_gets_one_line_updated_in_place(info_logged, caplog):
    clock, tty = Clock(), Tty()
    r = WaitReporter(S, "me", stream=tty, clock=clock)
    r.start()
    with caplog.at_level(logging.INFO, logger="elaunch.rendezvous"):
        for t in (2.0, 2.2, 2.5, 3.0):
            clock.t = t
            r.update(st(participants={"me": -1, "b": -1}, deadline=NOW + 5), NOW, NOW + 60)
        r.finish()
    out = tty.getvalue()
    assert out.count("\r\x1b[K") == 3 and out.endswith("\n") and out.count("\n") == 1, repr(out)
    assert not caplog.records  # no log lines besides the terminal's


def test_nothing_below_info():
    clock, stream = Clock(), Tty()
    r = WaitReporter(S, "me", stream=stream, clock=clock)
    r.start()
    clock.t = 10.0
    r.update(st(participants={"me": -1}), NOW, NOW + 60)
    r.finish()
    assert stream.getvalue() == ""
