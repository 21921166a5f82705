"""FileTimerWatchdog's polls against torch's real FileTimerClient, plus the decision functions as tables."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from elaunch.agent.file_timer import (
    ENABLE_ENV,
    FILE_ENV,
    Expired,
    FileTimerWatchdog,
    TimerRequest,
    apply_requests,
    due,
    file_timer_env,
)
from elaunch.agent.watchdog import Alarm, send_signals
from tests.conftest import wait_for
from tests.helpers import alive, kill_tree

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from torch.distributed.elastic.timer import FileTimerClient, configure, expires

    configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    mode = sys.argv[1]
    if mode == "hang":
        with expires(after=1, scope="hang-scope"):
            time.sleep(60)
    elif mode == "in-time":
        with expires(after=1, scope="quick-scope"):
            pass
        time.sleep(2.5)  # outlive the released timer's expiry by well over a check interval
    elif mode == "die-holding":
        with expires(after=30, scope="never-released"):
            os._exit(3)
    print("done", flush=True)
    """
)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_log():
    """WARNING lines of the agent's logger (attached directly: "elaunch" may not propagate)."""
    logger = logging.getLogger("elaunch.agent")
    handler = _Records()
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


@pytest.fixture
def timer(tmp_path):
    """A FileTimerWatchdog on a fresh FIFO, closed (the FIFO removed) after the test."""
    watchdog = FileTimerWatchdog(str(tmp_path / "timer.fifo"), interval_s=0.1)
    yield watchdog
    watchdog.close()
    assert not os.path.exists(watchdog.path)


def _polled(watchdog: FileTimerWatchdog, until, timeout: float, what: str) -> list[Alarm]:
    """Poll ``watchdog`` as the monitor does (``watched`` is not read) until ``until(alarms)``; the alarms seen."""
    alarms: list[Alarm] = []

    def look():
        alarm = watchdog.poll(None)
        if alarm is not None:
            alarms.append(alarm)
        return until(alarms)

    wait_for(look, timeout, interval=watchdog.interval, what=what)
    return alarms


@pytest.fixture
def worker(tmp_path, timer):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs: list[subprocess.Popen] = []

    def start(mode: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(timer.env(0))
        proc = subprocess.Popen([sys.executable, str(script), mode], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        kill_tree(proc.pid)
        proc.communicate(timeout=10)


@pytest.mark.slow
def test_an_expired_scope_alarms_with_its_signal_and_the_monitor_kills_the_worker(timer, worker, warnings_log):
    proc = worker("hang")
    _polled(timer, lambda _: timer.timers(), 60, "the worker to acquire its timer")
    (request,) = timer.timers().values()
    assert (request.pid, request.scope_id, request.signal) == (proc.pid, "hang-scope", signal.SIGKILL)
    (alarm,) = _polled(timer, bool, request.expiration_time - time.time() + 5, "the expiry")
    assert time.time() >= request.expiration_time
    assert alarm.signals == {proc.pid: signal.SIGKILL} and alarm.kind == "file_timer"
    assert not alarm.fails and alarm.failures == {}  # the worker's exit tells the monitor the rest
    assert timer.timers() == {}
    assert proc.poll() is None  # the watchdog only names it: the monitor sends the signal
    send_signals(alarm.signals)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    (line,) = [x for x in warnings_log if "hang-scope" in x]
    assert f"pid {proc.pid}" in line and "expired" in line and "s ago" in line and "SIGKILL" in line
    assert timer.poll(None) is None  # acted on once


@pytest.mark.slow
def test_released_scope_is_not_killed(timer, worker, warnings_log):
    proc = worker("in-time")
    alarms = _polled(timer, lambda _: proc.poll() is not None, 60, "the worker to end")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.strip() == "done"
    assert alarms == [] and timer.poll(None) is None and timer.timers() == {} and warnings_log == []


@pytest.mark.slow
def test_timers_of_a_dead_worker_are_dropped(timer, worker):
    proc = worker("die-holding")
    proc.communicate(timeout=60)
    assert proc.returncode == 3
    # Its release never came; the watchdog notices the pid is gone at its next poll.
    alarms = _polled(timer, lambda _: timer.timers() == {}, 5, "the dead worker's timer to be dropped")
    assert alarms == []


def _send(path: str, line: str) -> None:
    """Write one request line the way torch's client does (non-blocking open, one write)."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")


def _line(pid: int, scope: str, expiration_time: float, sig: int) -> str:
    return (f'{{"version": 1, "pid": {pid}, "scope_id": "{scope}", "expiration_time": {expiration_time}, '
            f'"signal": {sig}}}')


def test_protocol_without_torch(timer, warnings_log):
    """Acquire/release, bad lines, a zero signal, an expired timer: one poll each, nothing signalled."""
    me = os.getpid()  # alive, so the timer is not dropped as a dead pid's
    now = time.time()
    _send(timer.path, _line(me, "a", now + 600, 9))
    _send(timer.path, "not json")
    _send(timer.path, _line(0, "group", now - 1, 9))  # pid 0 would be the agent's own process group
    assert timer.poll(None) is None and set(timer.timers()) == {(me, "a")}
    _send(timer.path, _line(me, "a", -1, 0))
    assert timer.poll(None) is None and timer.timers() == {}
    _send(timer.path, _line(me, "z", now - 1, 0))
    assert timer.poll(None) is None and timer.timers() == {}
    assert any("'z'" in x and "its timer carries no signal" in x for x in warnings_log)
    _send(timer.path, _line(me, "b", now - 2, 15))
    alarm = timer.poll(None)
    assert alarm is not None and alarm.signals == {me: 15} and timer.timers() == {}
    assert any("bad timer request b'not json'" in x for x in warnings_log)
    assert any("pid 0 is not a process id" in x for x in warnings_log)


def test_a_scope_of_a_process_that_is_no_worker_signals_exactly_that_process(timer, tmp_path):
    """As torch: ``os.kill`` of the registered pid (here a worker's child), not of its process group."""
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pids)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)])
    try:
        child = int(wait_for(lambda: pids.exists() and pids.read_text(), 30, what="the child's pid"))
        _send(timer.path, _line(child, "child-scope", time.time() - 1, signal.SIGTERM))
        alarm = timer.poll(None)
        assert alarm is not None and alarm.signals == {child: signal.SIGTERM}
        send_signals(alarm.signals)
        wait_for(lambda: not alive(child), 10, what="the child killed")
        assert parent.poll() is None  # same process group, not signalled
    finally:
        kill_tree(parent.pid)
        parent.wait(timeout=10)


def test_open_close_without_clients_and_path_checks(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # stale FIFO from an earlier run: replaced
    watchdog = FileTimerWatchdog(str(path))
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert watchdog.polls and watchdog.interval == 0.1 and watchdog.env(3) == {FILE_ENV: str(path)}
    watchdog.close()
    assert not path.exists()
    watchdog.close()  # idempotent
    assert watchdog.poll(None) is None
    path.write_text("user data")
    with pytest.raises(FileExistsError, match="is not a FIFO"):
        FileTimerWatchdog(str(path))
    assert path.read_text() == "user data"
    with pytest.raises(ValueError, match=r"interval_s \(0\) must be > 0"):
        FileTimerWatchdog(str(path), interval_s=0)


ENV_CASES = {
    "unset": ({}, (False, "")),
    "enabled, no path": ({ENABLE_ENV: "1"}, (True, "<temp>")),
    "enabled, empty path counts as unset": ({ENABLE_ENV: "1", FILE_ENV: ""}, (True, "<temp>")),
    "enabled with path": ({ENABLE_ENV: "1", FILE_ENV: "/x/t"}, (True, "/x/t")),
    "only exactly '1' enables": ({ENABLE_ENV: "true", FILE_ENV: "/x/t"}, (False, "/x/t")),
    "zero": ({ENABLE_ENV: "0"}, (False, "")),
}


@pytest.mark.parametrize("environ, expected", ENV_CASES.values(), ids=ENV_CASES.keys())
def test_file_timer_env(environ, expected):
    enabled, path = file_timer_env(environ)
    if expected[1] == "<temp>":
        assert enabled is True
        assert os.path.dirname(path) == tempfile.gettempdir()
        assert os.path.basename(path).startswith("watchdog_timer_")
        assert file_timer_env(environ)[1] != path, "a fresh path each call"
    else:
        assert (enabled, path) == expected


def _r(pid, scope, exp, sig=9):
    return TimerRequest(pid, scope, exp, sig)


APPLY_CASES = {
    "acquire": ({}, [_r(1, "a", 10)], {(1, "a"): _r(1, "a", 10)}),
    "re-acquire replaces": ({(1, "a"): _r(1, "a", 10)}, [_r(1, "a", 20)], {(1, "a"): _r(1, "a", 20)}),
    "release": ({(1, "a"): _r(1, "a", 10)}, [_r(1, "a", -1, 0)], {}),
    "release of unknown scope": ({(1, "a"): _r(1, "a", 10)}, [_r(2, "a", -1, 0)], {(1, "a"): _r(1, "a", 10)}),
    "acquire then release in one batch": ({}, [_r(1, "a", 10), _r(1, "a", -1, 0)], {}),
}


@pytest.mark.parametrize("timers, requests, expected", APPLY_CASES.values(), ids=APPLY_CASES.keys())
def test_apply_requests(timers, requests, expected):
    assert apply_requests(timers, requests) == expected


DUE_CASES = {
    "none expired": ([_r(1, "a", 10.5)], {}),
    "expiry at exactly now counts": ([_r(1, "a", 10)], {1: Expired(_r(1, "a", 10), 0.0, ("a",))}),
    "earliest with a signal wins": (
        [_r(1, "late", 9), _r(1, "nosig", 5, 0), _r(1, "early", 7, 15), _r(1, "future", 20)],
        {1: Expired(_r(1, "early", 7, 15), 3.0, ("nosig", "early", "late"))},
    ),
    "no signal at all: earliest, signal 0": (
        [_r(2, "b", 8, 0), _r(2, "a", 6, -1)],
        {2: Expired(_r(2, "a", 6, -1), 4.0, ("a", "b"))},
    ),
    "per pid": (
        [_r(1, "a", 9), _r(2, "a", 4)],
        {1: Expired(_r(1, "a", 9), 1.0, ("a",)), 2: Expired(_r(2, "a", 4), 6.0, ("a",))},
    ),
}


@pytest.mark.parametrize("timers, expected", DUE_CASES.values(), ids=DUE_CASES.keys())
def test_due(timers, expected):
    assert due({t.key: t for t in timers}, now=10.0) == expected


def test_parse_matches_torch_client_format():
    line = '{"version": 1, "pid": 12, "scope_id": "train.py#3", "expiration_time": 1700000000.25, "signal": 9}'
    assert TimerRequest.parse(line) == TimerRequest(12, "train.py#3", 1700000000.25, 9)
    with pytest.raises(ValueError, match="bad timer request"):
        TimerRequest.parse('{"pid": 12}')
