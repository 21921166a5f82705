"""Notices: what the signal handler records, and the loop's take (pure logic, no signals)."""

from __future__ import annotations

import signal

from elaunch.agent.notices import Notices


def test_record_queues_and_wakes_take_acts_in_order_once():
    acted, woken = [], []
    clock = iter([1.0, 2.0]).__next__
    notices = Notices(lambda sig, at, target: acted.append((sig, at, target)), clock=clock)
    notices.wake_with(lambda: woken.append(True))
    notices.record(signal.SIGUSR1, "group-a")
    notices.record(signal.SIGUSR2, None)
    assert (acted, woken, notices.pending()) == ([], [True, True], 2)  # recording acts on nothing
    assert notices.take() == 2
    assert acted == [(signal.SIGUSR1, 1.0, "group-a"), (signal.SIGUSR2, 2.0, None)]
    assert (notices.take(), notices.pending()) == (0, 0)


def test_no_wake_once_cleared_and_poll_is_take_without_an_alarm():
    acted, woken = [], []
    notices = Notices(lambda sig, at, target: acted.append(sig), clock=lambda: 0.0)
    notices.wake_with(lambda: woken.append(True))
    notices.wake_with(None)  # the agent, before the group's wake pipe closes
    notices.record(signal.SIGUSR1)
    assert woken == []
    assert notices.poll(None) is None and acted == [signal.SIGUSR1]
    assert (notices.polls, notices.interval, notices.env(0)) == (False, None, {})


def test_a_notice_recorded_while_acting_is_acted_on_in_the_same_take():
    acted = []
    notices = Notices(lambda sig, at, target: (acted.append(sig), len(acted) == 1 and notices.record(signal.SIGUSR2)),
                      clock=lambda: 0.0)
    notices.record(signal.SIGUSR1)
    assert notices.take() == 2 and acted == [signal.SIGUSR1, signal.SIGUSR2]
