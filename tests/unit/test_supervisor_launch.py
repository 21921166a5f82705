"""The launch's supervisor (elaunch.supervision, issue 37): the helpers that live for the whole launch,
and an attempt's console copy (tee).

The ``--metrics-port`` server and the rendezvous' keep-alive are declared on the same supervisor
as the run's helpers: the run's end (``close(below=LAUNCH)``, the launcher's) leaves them, the
launch's close stops them after everything else; each one dying is one WARNING line.
"""

from __future__ import annotations

import io
import logging
import socket
import time
from types import SimpleNamespace

from elaunch.agent.metrics import AgentMetrics
from elaunch.procs.tee import Tee
from elaunch.rendezvous.dynamic.keepalive import KeepAlive
from elaunch.rendezvous.dynamic.stalls import StoreStalls
from elaunch.supervision import LAUNCH, METRICS, OFF, RENDEZVOUS, SERVICES, STORE, THREADS, Supervisor

from tests.conftest import wait_for

from .test_supervisor import Fake, FakeReaper

_SETTINGS = SimpleNamespace(heartbeat_interval=0.01, probe_timeout=1.0, heartbeat_timeout=1.0)


class _Backend:
    """A heartbeat backend that counts beats; ``broken`` makes the keep-alive's loop itself raise."""

    def __init__(self, broken: bool = False) -> None:
        self.beats = 0
        self._broken = broken

    @property
    def cheap_heartbeats(self) -> bool:
        if self._broken:
            raise RuntimeError("backend gone")
        return True

    def beat(self, node_id: str, now: float) -> None:
        self.beats += 1


def _keep_alive(backend: _Backend) -> KeepAlive:
    return KeepAlive("n0", _SETTINGS, backend, time.time, StoreStalls(time.time, 1.0))


def _assert_free(port: int) -> None:
    """Nothing listens on ``port`` any more (SO_REUSEADDR: a closed connection's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _warnings_of_two_looks(sup: Supervisor, caplog) -> list[str]:
    """The WARNING lines of two of the monitor's looks (``check_all``): a dead helper is told once, not at each."""
    with caplog.at_level(logging.WARNING):
        sup.check_all()
        sup.check_all()
    return _warnings(caplog)


def test_the_runs_end_leaves_the_launchs_helpers_which_stop_last_in_tier_order():
    stops: list = []
    sup = Supervisor()
    sup.add(Fake("metrics server", stops), METRICS, on_death=OFF, wakes=False)
    sup.add(Fake("keep-alive", stops), RENDEZVOUS, on_death=OFF, wakes=False)
    sup.reaper = FakeReaper(stops)  # the run's (the launcher's open)
    sup.add(Fake("store host", stops), STORE, watched=False)
    sup.add(Fake("sampler", stops), THREADS, on_death=OFF, wakes=False)
    sup.add(Fake("persister", stops), SERVICES)
    sup.close(below=LAUNCH)  # the run's end
    assert stops == ["sampler", "persister", "store host", "reaper"]
    sup.close()  # the launch's end: the rendezvous' threads, then the metrics port
    assert stops == ["sampler", "persister", "store host", "reaper", "keep-alive", "metrics server"]


def test_keep_alive_beats_on_the_supervisor_and_stops_at_close():
    backend = _Backend()
    sup = Supervisor()
    ka = sup.add(_keep_alive(backend), RENDEZVOUS, on_death=OFF, wakes=False, start=True)
    wait_for(lambda: backend.beats >= 2, 5.0)
    thread = ka.thread
    sup.close(below=LAUNCH)
    assert thread.is_alive() and sup.has(ka)  # the run's end leaves it to the handler or the launch
    sup.close()
    assert not thread.is_alive() and not ka.running


def test_a_keep_alive_that_died_is_one_warning_and_is_stopped(caplog):
    sup = Supervisor()
    ka = sup.add(_keep_alive(_Backend(broken=True)), RENDEZVOUS, on_death=OFF, wakes=False, start=True,
                 note="this node's heartbeat is no longer written")
    wait_for(lambda: not ka.thread.is_alive(), 5.0)
    assert _warnings_of_two_looks(sup, caplog) == ["rendezvous keep-alive thread died: RuntimeError: backend gone; "
                                 "this node's heartbeat is no longer written"]
    assert not sup.has(ka) and not ka.running


def test_the_metrics_server_that_died_is_one_warning_and_its_port_is_freed(caplog):
    metrics = AgentMetrics("job", "n0", "default")
    _, port = metrics.serve(0, "127.0.0.1")
    sup = Supervisor()
    sup.add(metrics, METRICS, on_death=OFF, wakes=False, note="/metrics is not served any more")
    assert sup.private_fds() == (metrics._server.fileno(),)  # a forked worker does not keep the port
    metrics._server.shutdown()  # its serving thread ends
    wait_for(lambda: not metrics._thread.is_alive(), 5.0)
    assert _warnings_of_two_looks(sup, caplog) == [f"metrics server thread died: nothing answers on port {port}; "
                                 "/metrics is not served any more"]
    assert not sup.has(metrics)
    _assert_free(port)


def test_the_metrics_server_serves_until_the_launchs_close():
    metrics = AgentMetrics("job", "n0", "default")
    _, port = metrics.serve(0, "127.0.0.1")
    sup = Supervisor(FakeReaper([]))
    sup.add(metrics, METRICS, on_death=OFF, wakes=False)
    sup.close(below=LAUNCH)
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # still serving after the run
    sup.close()
    _assert_free(port)


def _failing_tee(tmp_path) -> Tee:
    """A console copy of a "file" that is a directory: its first look raises IsADirectoryError, which ends it."""
    path = tmp_path / "out.log"
    path.mkdir()
    return Tee([(str(path), io.StringIO(), "[default0]:")], interval=0.01, use_inotify=False)


def test_a_tee_that_died_is_one_warning_at_the_next_look_and_stops_with_the_threads(tmp_path, caplog):
    stops: list = []
    sup = Supervisor(FakeReaper(stops))
    sup.add(Fake("store host", stops), STORE, watched=False)
    tee = sup.add(_failing_tee(tmp_path), THREADS, on_death=OFF, wakes=False, start=True,
                  note="worker output is not copied to the console any more")
    wait_for(lambda: not tee._thread.is_alive(), 5.0)
    assert _warnings_of_two_looks(sup, caplog) == [f"tee thread died: IsADirectoryError: [Errno 21] Is a directory: '{tmp_path / 'out.log'}'; "
                                 "worker output is not copied to the console any more"]
    assert not sup.has(tee)
    live = sup.add(Tee([(str(tmp_path / "other.log"), io.StringIO(), "p:")], interval=0.01), THREADS,
                   on_death=OFF, wakes=False, start=True)
    sup.close(below=LAUNCH)
    assert live._thread is None and stops == ["store host", "reaper"]  # the copy stopped first


def test_a_tee_that_died_unseen_is_one_warning_at_its_stop(tmp_path, caplog):
    tee = _failing_tee(tmp_path).start()
    wait_for(lambda: not tee._thread.is_alive(), 5.0)
    with caplog.at_level(logging.WARNING):
        tee.stop()
        tee.stop()
    assert _warnings(caplog) == [f"tee thread died: IsADirectoryError: [Errno 21] Is a directory: '{tmp_path / 'out.log'}'; "
                                 "worker output was not copied to the console since"]
