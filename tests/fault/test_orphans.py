"""No worker outlives its agent: kill -9 of a launcher using WorkerProcesses + reaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest


from elaunch.procs import start_reaper
from tests.conftest import SCRIPTS, track_processes, wait_for


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _read_pids(path) -> list[int]:
    pids = [int(x) for x in open(path).read().split()]
    track_processes(pids)  # orphans escape the descendant check: the shared fixture checks these too
    return pids


def test_kill_9_of_launcher_leaves_no_worker_or_grandchild(tmp_path):
    launcher = subprocess.Popen([sys.executable, str(SCRIPTS / "procs_launcher.py"), str(tmp_path)])
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or launcher.poll() is not None, 30, what="launcher ready")
        assert launcher.poll() is None, "launcher died early"
        reaper, *workers = _read_pids(tmp_path / "launcher.pids")
        w0, g0 = _read_pids(tmp_path / "w0.pid")
        w1, g1 = _read_pids(tmp_path / "w1.pid")
        assert {w0, w1} == set(workers)
        assert os.getsid(g1) == g1 and os.getsid(g0) == w0  # g1 left its worker's session
        tree = [reaper, w0, g0, w1, g1]
        assert not any(_gone(p) for p in tree)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        wait_for(lambda: all(_gone(p) for p in tree), 15, what=f"processes {tree} to be gone")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_kill_9_right_after_adopting_a_setsid_orphan_leaves_no_process(tmp_path):
    """The launcher adopted a worker's setsid'd daemon (child subreaper) and is killed before it looked at it.

    The daemon was never a child of the worker the watchdog watches, nor in its
    session; the watchdog finds it at the launcher's death by the worker's env
    entries it carries. (It used to rely on a snapshot the agent sent once a second.)
    """
    launcher = subprocess.Popen([sys.executable, str(SCRIPTS / "procs_launcher.py"), str(tmp_path), "daemon"])
    sleeper = None
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or launcher.poll() is not None, 30, what="launcher ready")
        assert launcher.poll() is None, "launcher died early"
        reaper, worker = _read_pids(tmp_path / "launcher.pids")
        _, sleeper = _read_pids(tmp_path / "w0.pid")
        assert _gone(worker) and psutil.Process(sleeper).ppid() == launcher.pid and os.getsid(sleeper) != worker
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        wait_for(lambda: _gone(reaper), 15, what="the watchdog to finish")
        assert _gone(sleeper), "the adopted daemon outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if sleeper is not None and not _gone(sleeper):
            os.kill(sleeper, signal.SIGKILL)


@pytest.mark.parametrize("worker_dies_first", [False, True], ids=["tree-intact", "orphaned-setsid-child"])
def test_reaper_kills_watched_trees_on_eof_and_exits(tmp_path, worker_dies_first):
    """Closing the pipe (what the kernel does when the agent dies) kills watched trees.

    With ``worker_dies_first`` the worker is gone before the EOF, so its setsid'd
    child is linked to nothing: only the worker's env entries it carries (given
    to ``watch``) find it.
    """
    reaper = start_reaper()
    marker = f"TORCHELASTIC_ERROR_FILE={tmp_path / 'error.json'}"
    child = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "procs_worker.py"), "--child", "setsid", "--pidfile", str(tmp_path / "p"),
         "--sleep", "300"],
        start_new_session=True, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json")),
    )
    try:
        wait_for(lambda: (tmp_path / "p").exists(), 20, what="pidfile")
        worker, grandchild = _read_pids(tmp_path / "p")
        reaper.watch([worker], {worker: {marker.encode()}})
        assert reaper.sync()
        if worker_dies_first:
            child.kill()
            child.wait(10)
            wait_for(lambda: psutil.Process(grandchild).ppid() != worker, 10, what="grandchild orphaned")
        reaper._close_fd()  # EOF with the worker still watched, as if the agent died
        reaper._proc.wait(10)
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
        wait_for(lambda: _gone(grandchild), 10, what="grandchild gone")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        reaper.close()


def test_reaper_exits_on_close_and_spares_forgotten(tmp_path):
    reaper = start_reaper()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        reaper.watch([child.pid])
        reaper.forget([child.pid])
        assert reaper.sync()
        reaper.close()
        assert not reaper.alive()
        assert child.poll() is None  # forgotten: not killed
    finally:
        child.kill()
        child.wait()


def test_reaper_ignores_terminal_signals():
    reaper = start_reaper()
    try:
        assert reaper.sync()  # handlers installed before the first command is read
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(reaper.pid, sig)
        assert reaper.sync() and reaper.alive()
    finally:
        reaper.close()
    assert not reaper.alive()
