"""The agent's helper-process shape (``procs.helper_process``) with a real tiny child.

A helper that dies is restarted while its budget lasts and then reported in one
line, and what it forked goes with it; stop() ends it (SIGTERM, grace, SIGKILL) with whatever it forked, and
reaps it; a ``kill -9`` of the agent takes the helper and its group with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import psutil
import pytest

from elaunch.procs.helper_process import HelperDied, HelperProcess
from tests.conftest import SCRIPTS, track_processes, wait_for

CHILD = str(SCRIPTS / "helper_child.py")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ask(helper: HelperProcess, msg: str) -> str:
    helper.chan.send(msg.encode())
    return helper.chan.recv(64).decode()


def died(helper: HelperProcess) -> None:
    wait_for(lambda: psutil.Process(helper.pid).status() == psutil.STATUS_ZOMBIE, 10, what="the helper's exit")


@pytest.mark.parametrize("how, line", [("exit 3", "exited with status 3"), ("SIGKILL", "was killed by SIGKILL")])
def test_a_helper_that_dies_is_reported_in_one_line(how, line):
    helper = HelperProcess("tiny", CHILD)
    try:
        helper.start()
        assert ask(helper, "ping") == "pong" and not helper.check()
        pid, sleeper = helper.pid, int(ask(helper, "fork"))
        track_processes([sleeper])
        if how == "SIGKILL":
            os.kill(pid, signal.SIGKILL)
        else:
            helper.chan.send(how.encode())
        died(helper)
        with pytest.raises(HelperDied) as err:
            helper.check()
        assert str(err.value) == f"tiny (pid {pid}) {line}" and isinstance(err.value, OSError)
        assert helper.pid is None and helper.chan is None and gone(pid)
        wait_for(lambda: gone(sleeper), 10, what="the dead helper's forked child gone")
    finally:
        helper.stop()


def test_a_helper_that_dies_is_restarted_while_its_budget_lasts(caplog):
    helper = HelperProcess("tiny", CHILD, restarts=2)
    try:
        helper.start()
        pids = [helper.pid]
        for n in (1, 2):
            helper.chan.send(b"exit 1")
            died(helper)
            with caplog.at_level(logging.WARNING, logger="elaunch.procs.helper_process"):
                assert helper.check()
            assert f"tiny (pid {pids[-1]}) exited with status 1; restarting it ({n} of 2)" in caplog.text
            assert helper.pid not in pids and gone(pids[-1])
            pids.append(helper.pid)
            assert ask(helper, "ping") == "pong"  # a new channel to the new child
        helper.chan.send(b"exit 1")
        died(helper)
        with pytest.raises(HelperDied, match=rf"^tiny \(pid {pids[-1]}\) exited with status 1$"):
            helper.check()
    finally:
        helper.stop()


@pytest.mark.parametrize("modes, grace, code", [
    (("ignore-eof",), 30.0, -signal.SIGTERM),
    (("ignore-eof", "ignore-term"), 0.5, -signal.SIGKILL),  # after the grace period
    (("ignore-eof",), 0.0, -signal.SIGKILL),  # at once
])
def test_stop_ends_the_helper_and_what_it_forked_and_reaps_it(modes, grace, code):
    helper = HelperProcess("tiny", CHILD, *modes, grace=grace)
    helper.start()
    try:
        pid, sleeper = helper.pid, int(ask(helper, "fork"))
        track_processes([sleeper])
    finally:
        assert helper.stop() == code
    assert helper.stop() is None  # idempotent
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(pid)  # reaped, not a zombie
    wait_for(lambda: gone(sleeper), 10, what="the helper's forked child gone")


def test_kill_9_of_the_agent_kills_the_helper_and_its_group(tmp_path):
    # the driver restarts its helper once, so the restarted one is what the reaper must know
    driver = subprocess.Popen([sys.executable, str(SCRIPTS / "helper_driver.py"), str(tmp_path)])
    try:
        wait_for(lambda: (tmp_path / "pids").exists() or driver.poll() is not None, 60, what="driver ready")
        assert driver.poll() is None, "the driver died early"
        pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
        track_processes(pids)
        assert not any(gone(p) for p in pids)
        driver.kill()
        driver.wait()
        wait_for(lambda: all(gone(p) for p in pids), 10, what="helper and its forked child gone")
    finally:
        driver.kill()
        driver.wait()
