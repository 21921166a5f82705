"""Forwarded notices (``--forward-signals``) with real signals to a real agent process.

The agent's signal handler only records a notice and wakes the loop; the loop
forwards it to the workers, writes the ``notice`` event and logs it. A spy agent
(``tests/scripts/notice_spy_agent.py``) reports any event, signal or log line made
while the handler's frame is on the stack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from elaunch.agent.decide import Verdict
from elaunch.agent.events import AgentEvents
from elaunch.agent.job import JobView
from elaunch.agent.monitor import GroupMonitor
from elaunch.agent.notices import Notices
from elaunch.procs import LogsSpec, RunLogDir, WorkerProcesses, spawn, start_reaper
from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.standalone import StandaloneRendezvous
from elaunch.spec import Worker, WorkerGroup, WorkerSpec
from tests.conftest import wait_for
from tests.helpers import SCRIPTS, kill_tree, launcher_env

WORKER = str(SCRIPTS / "notice_worker.py")
SPY = str(SCRIPTS / "notice_spy_agent.py")


def _got(out, rank: int) -> int:
    try:
        return len((out / f"got_{rank}").read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_the_handler_only_records_and_the_loop_forwards_each_notice(tmp_path):
    out, logs, spy = tmp_path / "out", tmp_path / "logs", tmp_path / "spy.txt"
    out.mkdir()
    # --monitor-interval=3600: only the handler's wakeup can make the loop act before the deadlines below
    agent = subprocess.Popen(
        [sys.executable, SPY, "--standalone", "--nproc-per-node=2", "--monitor-interval=3600", f"--log-dir={logs}",
         WORKER, str(out)],
        env=launcher_env(NOTICE_SPY_OUT=str(spy)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 60, what="both workers ready")
        for n in range(1, 4):
            agent.send_signal(signal.SIGUSR1)
            wait_for(lambda: all(_got(out, r) == n for r in (0, 1)), 30, what=f"notice {n} at both workers")
        (out / "stop").touch()
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
        agent.communicate()
    assert agent.returncode == 0, err[-3000:]
    assert not spy.exists(), f"work done inside the signal handler:\n{spy.read_text()}"
    assert err.count("received SIGUSR1: forwarded to the workers") == 3, err[-3000:]
    (events,) = logs.rglob("events.jsonl")
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert kinds.count("notice") == 3 and kinds.index("notice") > kinds.index("workers_started"), kinds


class _NoticeOnSecondLook:
    """A watchdog that records a notice during the monitor's second look, after the notices were polled:
    as if the handler ran just before the wait, where the wait is not yet the signal wakeup fd."""

    polls, interval = False, None

    def __init__(self, notices: Notices, procs) -> None:
        self._notices, self._procs, self.looks = notices, procs, 0

    def env(self, local_rank):
        return {}

    def new_attempt(self, round):
        pass

    def poll(self, watched):
        self.looks += 1
        if self.looks == 2:
            self._notices.record(signal.SIGUSR1, self._procs)

    def close(self):
        pass


def test_a_notice_recorded_just_before_the_wait_wakes_it(tmp_path):
    # standalone, no watchdog that polls: after its first look the monitor sleeps until a worker exits.
    # The notice's act kills the worker: FAILED. Were the wait not woken, the worker's 60 s sleep ends first: SUCCEEDED.
    reaper = start_reaper()
    spec = LogsSpec(log_dir=str(tmp_path / "logs"))
    logs = RunLogDir(spec, "t").attempt(0, 1)
    procs = WorkerProcesses.start({0: [sys.executable, str(SCRIPTS / "procs_worker.py"), "--sleep", "60"]},
                                  {0: dict(os.environ)}, logs, spec, {}, reaper=reaper)
    acted = []

    def act(sig, at, target):
        acted.append((sig, target))
        target.notify(signal.SIGKILL)

    try:
        notices = Notices(act)
        notices.wake_with(procs.wakeup)  # as the agent does once the group started
        late = _NoticeOnSecondLook(notices, procs)
        rdzv = StandaloneRendezvous("notice-test", NodeInfo("127.0.0.1", "default", 1))
        monitor = GroupMonitor(rdzv, JobView(rdzv, 0), AgentEvents(None, "", "host", 0), interval=0.1,
                               watchdogs=[notices, late])
        group = WorkerGroup(spec=WorkerSpec(role="default", local_world_size=1, cmd=("x",)),
                            workers=[Worker(local_rank=0, global_rank=0)], round=0)
        verdict = monitor.watch(procs, group, logs, None)
    finally:
        procs.close()
        reaper.close()
        spawn._prctl(spawn._PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # pytest is no agent
    assert (verdict, acted, procs.poll()) == (Verdict.FAILED, [(signal.SIGUSR1, procs)], {0: -signal.SIGKILL})
