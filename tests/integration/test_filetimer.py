"""FileTimerServer against torch's real FileTimerClient, plus the decision functions as tables."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from elaunch.procs.filetimer import (
    ENABLE_ENV,
    FILE_ENV,
    Expired,
    FileTimerServer,
    TimerRequest,
    apply_requests,
    due,
    file_timer_env,
)
from tests.conftest import wait_for
from tests.helpers import kill_tree

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
    """WARNING lines of the file timer logger (attached directly: "elaunch" may not propagate)."""
    logger = logging.getLogger("elaunch.procs.filetimer")
    handler = _Records()
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


@pytest.fixture
def server(tmp_path):
    expired: list[Expired] = []
    srv = FileTimerServer(str(tmp_path / "timer.fifo"), interval_s=0.1, on_expired=expired.append)
    srv.expired = expired
    srv.start()
    yield srv
    srv.stop()
    assert not os.path.exists(srv.path)


@pytest.fixture
def worker(tmp_path, server):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs: list[subprocess.Popen] = []

    def start(mode: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env[FILE_ENV] = server.path
        proc = subprocess.Popen([sys.executable, str(script), mode], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        kill_tree(proc.pid)
        proc.communicate(timeout=10)


@pytest.mark.slow
def test_expired_scope_kills_the_worker(server, worker, warnings_log):
    proc = worker("hang")
    held = wait_for(lambda: server.timers(), 60, what="the worker to acquire its timer")
    (request,) = held.values()
    assert (request.pid, request.scope_id, request.signal) == (proc.pid, "hang-scope", signal.SIGKILL)
    proc.wait(timeout=request.expiration_time - time.time() + 3)
    assert proc.returncode == -signal.SIGKILL
    killed_at = time.time()
    assert killed_at - request.expiration_time < 3
    wait_for(lambda: server.expired, 5, what="on_expired")
    (expired,) = server.expired
    assert expired.request == request and expired.scopes == ("hang-scope",)
    assert 0 <= expired.overdue_s < 1
    (line,) = [x for x in warnings_log if "hang-scope" in x]
    assert f"pid {proc.pid}" in line and "expired" in line and "s ago" in line and "SIGKILL" in line
    assert server.timers() == {}


@pytest.mark.slow
def test_released_scope_is_not_killed(server, worker, warnings_log):
    proc = worker("in-time")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "done"
    assert server.timers() == {} and server.expired == [] and warnings_log == []


@pytest.mark.slow
def test_timers_of_a_dead_worker_are_dropped(server, worker):
    proc = worker("die-holding")
    proc.communicate(timeout=60)
    assert proc.returncode == 3
    # Its release never came; the server notices the pid is gone at its next check.
    wait_for(lambda: server.timers() == {}, 5, what="the dead worker's timer to be dropped")
    assert server.expired == []


def _send(path: str, line: str) -> None:
    """Write one request line the way torch's client does (non-blocking open, one write)."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")


def test_protocol_without_torch(tmp_path, warnings_log):
    """Acquire/release, a bad line, a zero signal, and an injected kill (no real process is hurt)."""
    kills: list[tuple[int, int]] = []
    me = os.getpid()  # alive, so the timer is not dropped as a dead pid's
    with FileTimerServer(str(tmp_path / "fifo"), interval_s=0.05, kill=lambda p, s: kills.append((p, s))) as srv:
        now = time.time()
        _send(srv.path, f'{{"version": 1, "pid": {me}, "scope_id": "a", "expiration_time": {now + 600}, "signal": 9}}')
        _send(srv.path, "not json")
        wait_for(lambda: set(srv.timers()) == {(me, "a")}, 5, what="acquire")
        _send(srv.path, f'{{"version": 1, "pid": {me}, "scope_id": "a", "expiration_time": -1, "signal": 0}}')
        wait_for(lambda: srv.timers() == {}, 5, what="release")
        _send(srv.path, f'{{"version": 1, "pid": {me}, "scope_id": "z", "expiration_time": {now - 1}, "signal": 0}}')
        wait_for(lambda: any("'z'" in x for x in warnings_log), 5, what="the no-signal warning")
        _send(srv.path, f'{{"version": 1, "pid": {me}, "scope_id": "b", "expiration_time": {now - 2}, "signal": 15}}')
        wait_for(lambda: kills, 5, what="the injected kill")
        assert kills == [(me, 15)]
        assert srv.timers() == {}
    assert any("bad timer request b'not json'" in x for x in warnings_log)
    assert any("its timer carries no signal" in x for x in warnings_log)


def test_start_stop_without_clients_and_path_checks(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # stale FIFO from an earlier run: replaced
    srv = FileTimerServer(str(path))
    srv.start()
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    with pytest.raises(RuntimeError, match="already started"):
        srv.start()
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 2, "stop must not wait for a client"
    assert not path.exists()
    srv.stop()  # idempotent
    assert not any(t.name == "elaunch-file-timer" for t in threading.enumerate())
    path.write_text("user data")
    with pytest.raises(FileExistsError, match="is not a FIFO"):
        FileTimerServer(str(path)).start()
    assert path.read_text() == "user data"
    with pytest.raises(ValueError, match=r"interval_s \(0\) must be > 0"):
        FileTimerServer(str(path), interval_s=0)


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
