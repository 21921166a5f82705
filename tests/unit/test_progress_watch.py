"""The progress watch's events and how often it asks the monitor to look (real progress files, no workers)."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from elaunch.agent.progress_watch import MAX_LOOK, ProgressWatchdog


class Events:
    def __init__(self):
        self.got = []

    def training(self, step, at):
        self.got.append(("training", step, at))

    def caught_up(self, step):
        self.got.append(("caught_up", step))


def watched(codes=None):
    workers = [SimpleNamespace(local_rank=0), SimpleNamespace(local_rank=1)]
    return SimpleNamespace(group=SimpleNamespace(workers=workers), codes=codes or {0: None, 1: None})


def report(pw, rank, step=None, at=None):
    """What a worker's progress() writes: the first call's time, the counter, the step + 1."""
    with open(pw.files.progress_file(rank), "r+b") as f:
        words = [int.from_bytes(f.read(8), sys.byteorder) for _ in range(4)]
        words[0] += 1
        if step is not None:
            words[2] = step + 1
        if not words[3]:
            words[3] = int((at or time.time()) * 1e6)
        f.seek(0)
        f.write(b"".join(w.to_bytes(8, sys.byteorder) for w in words))


@pytest.fixture
def pw():
    ev = Events()
    w = ProgressWatchdog(range(2), ev, interval=0.1)
    w.ev = ev
    yield w
    w.close()


def test_training_waits_for_every_rank_backing_off_then_nothing_is_polled(pw):
    assert pw.look_within is None and not pw.polls  # no workers yet
    pw.new_attempt(0)
    looks = []
    for _ in range(8):
        looks.append(pw.look_within)
        pw.poll(watched())
    assert looks == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, MAX_LOOK, MAX_LOOK])
    report(pw, 0, at=1000.0)
    pw.poll(watched())
    assert pw.ev.got == []
    report(pw, 1, at=1001.5)
    pw.poll(watched())
    assert pw.ev.got == [("training", None, 1001.5)]  # dated by the last rank's first call
    assert pw.look_within is None and not pw.polls  # no steps to catch up to: the monitor may sleep
    pw.poll(watched())
    assert len(pw.ev.got) == 1
    assert pw.env(1)["ELAUNCH_PROGRESS_FILE"] == pw.files.progress_file(1)


def test_a_rank_that_exited_without_reporting_does_not_hold_training_back(pw):
    pw.new_attempt(0)
    report(pw, 0, step=3, at=5.0)
    pw.poll(watched({0: None, 1: 0}))
    assert pw.ev.got == [("training", 3, 5.0)]


def test_after_a_stop_at_a_step_the_next_attempt_polls_until_caught_up(pw):
    pw.new_attempt(0)
    report(pw, 0, step=10)
    report(pw, 1, step=12)
    pw.poll(watched())
    assert pw.stopped() == 12 and pw.look_within is None and not pw.polls
    pw.new_attempt(1)
    assert pw.files.steps() == {0: None, 1: None}
    assert pw.look_within == 0.1  # behind: no back-off
    report(pw, 0, step=5, at=1.0)
    report(pw, 1, step=5, at=2.0)
    pw.poll(watched())
    assert pw.ev.got[-1] == ("training", 5, 2.0)
    assert pw.polls and pw.look_within is None  # catching up: every --monitor-interval
    report(pw, 1, step=11)
    pw.poll(watched())
    assert pw.ev.got[-1][0] == "training"
    report(pw, 0, step=12)
    pw.poll(watched())
    assert pw.ev.got[-1] == ("caught_up", 12) and not pw.polls
    # stopped again before any step: the node's highest stays the one to catch up to
    assert pw.stopped() == 12
    pw.new_attempt(2)
    report(pw, 0, step=0)
    report(pw, 1, step=0)
    pw.poll(watched())
    assert pw.stopped() == 0
    pw.new_attempt(3)
    report(pw, 0, step=12)
    report(pw, 1, step=12)
    pw.poll(watched())
    assert pw.ev.got[-2:] == [("training", 12, pytest.approx(time.time(), abs=5)), ("caught_up", 12)]
