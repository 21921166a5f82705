"""The agent's supervisor without processes: stop order, policies, descriptors, threads (small fakes)."""

from __future__ import annotations

import logging
import threading

import pytest

from elaunch.procs.helper_process import HelperDied
from elaunch.supervision import OFF, REPORT, SERVICES, SPARES, STORE, THREADS, HelperThread, Supervisor


class Fake:
    """A helper whose check raises ``dies`` (an OSError) once set, and which records its stop in ``stops``."""

    def __init__(self, name: str, stops: list, fds=(), fails_to_close: bool = False) -> None:
        self.name, self._stops, self._fds, self._fails = name, stops, tuple(fds), fails_to_close
        self.dies: OSError | None = None
        self.started = self.closed = 0

    def start(self) -> None:
        self.started += 1

    def check(self) -> bool:
        if self.dies is not None:
            raise self.dies
        return False

    def private_fds(self):
        return self._fds

    def close(self) -> None:
        self.closed += 1
        self._stops.append(self.name)
        if self._fails:
            raise RuntimeError(f"{self.name} broke")


class FakeReaper:
    def __init__(self, stops: list) -> None:
        self._stops = stops

    def private_fds(self):
        return (90, 91)

    def close(self) -> None:
        self._stops.append("reaper")


def test_close_stops_by_tier_the_last_added_first_and_the_reaper_last_once():
    stops: list = []
    sup = Supervisor(FakeReaper(stops))
    store = sup.add(Fake("store host", stops), STORE, watched=False)
    sup.add(Fake("persister", stops), SERVICES)
    sup.add(Fake("pool", stops), SPARES)
    sup.add(Fake("replicas", stops), SERVICES)
    sup.close()
    assert stops == ["replicas", "persister", "pool", "store host", "reaper"]
    sup.close()
    assert stops == ["replicas", "persister", "pool", "store host", "reaper"]  # idempotent
    assert store.closed == 1


def test_every_helper_is_stopped_when_one_raises_and_the_first_error_comes_out():
    stops: list = []
    sup = Supervisor(FakeReaper(stops))
    sup.add(Fake("a", stops, fails_to_close=True), SERVICES)
    sup.add(Fake("b", stops, fails_to_close=True), SERVICES)
    sup.add(Fake("c", stops), STORE)
    with pytest.raises(RuntimeError, match="^b broke$"):
        sup.close()
    assert stops == ["b", "a", "c", "reaper"]


def test_private_fds_are_every_helpers_and_the_reapers():
    stops: list = []
    sup = Supervisor(FakeReaper(stops))
    sup.add(Fake("a", stops, (5,)), SERVICES)
    b = sup.add(Fake("b", stops, (7, 8)), STORE)
    assert sup.private_fds() == (5, 7, 8, 90, 91)
    sup.stop(b)
    assert sup.private_fds() == (5, 90, 91)
    assert stops == ["b"] and not sup.has(b)
    sup.stop(b)  # idempotent
    assert stops == ["b"]


def test_add_can_start_the_helper_and_refuses_one_twice_or_an_unknown_policy():
    sup = Supervisor()
    h = sup.add(Fake("a", []), SERVICES, start=True)
    assert h.started == 1 and sup.has(h)
    with pytest.raises(ValueError, match="a is supervised already"):
        sup.add(h, SERVICES)
    with pytest.raises(ValueError, match="on_death='restart'"):
        sup.add(Fake("b", []), SERVICES, on_death="restart")


def test_a_report_helper_that_died_raises_its_one_line():
    sup = Supervisor()
    h = sup.add(Fake("store host", []), STORE, on_death=REPORT)
    sup.check_all()
    h.dies = HelperDied("store host (pid 12) was killed by SIGKILL")
    with pytest.raises(HelperDied, match=r"^store host \(pid 12\) was killed by SIGKILL$"):
        sup.check_all()
    assert sup.has(h)  # the agent's run ends; close() stops it


def test_an_off_helper_that_died_is_one_warning_stopped_and_its_owner_told(caplog):
    told: list = []
    stops: list = []
    sup = Supervisor()
    h = sup.add(Fake("persister", stops), SERVICES, on_death=OFF, note="in-memory checkpoints go on without it",
                turned_off=lambda: told.append(1))
    assert sup.polls
    h.dies = HelperDied("persister (pid 3) exited with status 1")
    with caplog.at_level(logging.WARNING):
        sup.check_all()
    assert "persister (pid 3) exited with status 1; in-memory checkpoints go on without it" in caplog.text
    assert told == [1] and stops == ["persister"] and not sup.has(h)
    assert not sup.polls
    sup.check_all()  # gone: not checked again
    assert told == [1]


def test_an_unwatched_helper_is_left_to_its_feature():
    sup = Supervisor()
    h = sup.add(Fake("store host", []), STORE, watched=False)
    h.dies = HelperDied("store host (pid 1) exited with status 1")
    sup.check_all()
    assert not sup.polls and sup.has(h)


def test_a_thread_that_raises_is_reported_once_and_a_stopped_one_joins():
    ready = threading.Event()

    def boom(stop):
        ready.set()
        raise ValueError("bad port")

    t = HelperThread("metrics server", boom)
    t.start()
    assert ready.wait(5)
    t._thread.join(5)
    with pytest.raises(HelperDied, match=r"^metrics server thread died: ValueError: bad port$"):
        t.check()
    assert t.check() is False  # once
    t.close()

    ticks: list = []

    def loop(stop):
        while not stop.wait(0.01):
            ticks.append(1)

    t = HelperThread("sampler", loop)
    Supervisor().add(t, SERVICES, start=True)
    assert t.is_alive() and t.check() is False and t.private_fds() == ()
    t.close()
    assert not t.is_alive()
    t.close()


def test_a_dead_thread_off_is_one_warning_at_the_next_look_and_threads_stop_first(caplog):
    stops: list = []

    def boom(stop):
        raise RuntimeError("files gone")

    sup = Supervisor(FakeReaper(stops))
    sup.add(Fake("persister", stops), SERVICES, watched=False)
    t = sup.add(HelperThread("progress sampler", boom, thread_name="elaunch-progress-sampler"), THREADS,
                on_death=OFF, wakes=False, note="the gauges are dated at each scrape only", start=True)
    t._thread.join(5)
    assert t._thread.name == "elaunch-progress-sampler"
    assert not sup.polls  # a thread never makes the monitor wake every interval
    with caplog.at_level(logging.WARNING):
        sup.check_all()
        sup.check_all()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["progress sampler thread died: RuntimeError: files gone; the gauges are dated at each scrape only"]
    assert not sup.has(t)

    loop = sup.add(HelperThread("straggler watch", lambda stop: stop.wait(30) and stops.append("straggler watch")),
                   THREADS, on_death=OFF, wakes=False, start=True)
    sup.add(Fake("store host", stops), STORE, watched=False)
    sup.close()
    assert not loop.is_alive() and stops == ["straggler watch", "persister", "store host", "reaper"]
