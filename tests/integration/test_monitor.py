"""GroupMonitor with real workers: it polls the rendezvous only where something can change.

The rendezvous handlers are real (standalone) with a counter around
``num_nodes_waiting``; the "dynamic" one also says ``can_reform``, as the
c10d/etcd handlers do. No timing is asserted: a worker that runs 1 s gives a
polling monitor (0.1 s) many reads, an event-driven one a fixed few.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from elaunch.agent.decide import Verdict
from elaunch.agent.events import AgentEvents
from elaunch.agent.hang_watchdog import HangWatchdog
from elaunch.agent.job import JobView
from elaunch.agent.monitor import GroupMonitor
from elaunch.procs import LogsSpec, RunLogDir, WorkerProcesses, spawn, start_reaper
from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.standalone import StandaloneRendezvous
from elaunch.spec import Worker, WorkerGroup, WorkerSpec
from tests.conftest import SCRIPTS

WORKER = str(SCRIPTS / "procs_worker.py")


class CountingStandalone(StandaloneRendezvous):
    """The standalone handler, counting the monitor's membership reads."""

    def __init__(self, reform: bool = False) -> None:
        super().__init__("monitor-test", NodeInfo("127.0.0.1", "default", 1))
        self.reads = 0
        self.can_reform = reform

    def num_nodes_waiting(self) -> int:
        self.reads += 1
        return 0


def _monitor(rdzv, hang_timeout: float = 0.0) -> GroupMonitor:
    hangs = HangWatchdog(hang_timeout, range(1), rdzv, "host")
    return GroupMonitor(rdzv, JobView(rdzv, 0), AgentEvents(None, "", "host", 0), interval=0.1, watchdogs=[hangs])


@pytest.fixture
def run_one(tmp_path):
    """``run_one(monitor, seconds)``: one worker sleeping ``seconds`` (or running ``argv``), watched to its end -> Verdict."""
    reaper = start_reaper()
    started = []

    def _run(monitor: GroupMonitor, seconds: float, argv: list[str] | None = None,
             env: dict[str, str] | None = None) -> Verdict:
        spec = LogsSpec(log_dir=str(tmp_path / f"logs{len(started)}"))
        logs = RunLogDir(spec, "t").attempt(0, 1)
        argv = argv or [sys.executable, WORKER, "--sleep", str(seconds)]
        procs = WorkerProcesses.start({0: argv}, {0: {**os.environ, **(env or {})}}, logs, spec, {}, reaper=reaper)
        started.append(procs)
        group = WorkerGroup(spec=WorkerSpec(role="default", local_world_size=1, cmd=("x",)),
                            workers=[Worker(local_rank=0, global_rank=0)], round=0)
        return monitor.watch(procs, group, logs, None)

    yield _run
    for procs in started:
        procs.close()
    reaper.close()
    spawn._prctl(spawn._PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)  # pytest is no agent


def test_standalone_sleeps_until_the_worker_exits(run_one):
    rdzv = CountingStandalone()
    monitor = _monitor(rdzv)
    assert not monitor.polls()
    assert run_one(monitor, 1.0) is Verdict.SUCCEEDED
    # the first look, and one after the first short wait (when the errors module is loaded); then
    # nothing until the exit, which ends the watch before any read
    assert rdzv.reads <= 2


def test_a_rendezvous_that_can_change_is_polled_every_interval(run_one):
    rdzv = CountingStandalone(reform=True)
    monitor = _monitor(rdzv)
    assert monitor.polls()
    assert run_one(monitor, 1.0) is Verdict.SUCCEEDED
    assert rdzv.reads >= 3  # ~10 at 0.1 s over the worker's 1 s; 3 leaves room for a loaded machine


def test_the_progress_watch_looks_until_training_then_lets_a_standalone_monitor_sleep(run_one, tmp_path):
    import json

    from elaunch.agent.progress_watch import ProgressWatchdog

    rdzv = CountingStandalone()
    events = AgentEvents(str(tmp_path / "events.jsonl"), "n", "host", 0)
    progress = ProgressWatchdog(range(1), events, interval=0.1)
    hangs = HangWatchdog(0.0, range(1), rdzv, "host", progress=progress)
    monitor = GroupMonitor(rdzv, JobView(rdzv, 0), events, interval=0.1, watchdogs=[progress, hangs])
    try:
        progress.new_attempt(0)
        code = "import elaunch, time; time.sleep(0.3); elaunch.progress(step=4); time.sleep(3)"
        assert run_one(monitor, 0, argv=[sys.executable, "-c", code], env=progress.env(0)) is Verdict.SUCCEEDED
        kinds = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [(e["kind"], e["step"]) for e in kinds] == [("training", 4)]
        # backing off 0.1, 0.2, 0.4 ... s until training, then nothing until the exit: polling every
        # 0.1 s over the worker's ~3.5 s would be ~35 reads
        assert rdzv.reads <= 10
    finally:
        progress.close()


@pytest.mark.parametrize("hang_timeout, stuck, polls", [(0.0, False, False), (5.0, False, True), (0.0, True, True)])
def test_what_makes_the_monitor_poll(hang_timeout, stuck, polls):
    rdzv = CountingStandalone()
    hangs = HangWatchdog(hang_timeout, range(1), rdzv, "host")
    from elaunch.agent.stuck import UninterruptibleWatch

    watchdogs = [UninterruptibleWatch(60.0)] if stuck else []
    monitor = GroupMonitor(rdzv, JobView(rdzv, 0), AgentEvents(None, "", "host", 0), interval=0.1,
                           watchdogs=[*watchdogs, hangs])
    try:
        assert monitor.polls() is polls
    finally:
        hangs.close()


#: A worker holding a torch file-timer scope of 0.5 s (the client's JSON line, written by hand) around a long sleep.
TIMED = """
import json, os, time
line = json.dumps({"version": 1, "pid": os.getpid(), "scope_id": "x", "expiration_time": time.time() + 0.5,
                   "signal": 9})
fd = os.open(os.environ["TORCHELASTIC_TIMER_FILE"], os.O_WRONLY | os.O_NONBLOCK)
os.write(fd, (line + "\\n").encode())
os.close(fd)
time.sleep(60)
"""


def test_the_file_timer_is_read_at_its_own_interval_and_its_kill_fails_the_group_by_the_exit(run_one, tmp_path):
    """torch's file timer checks every 0.1 s, whatever ``--monitor-interval`` (here 30 s)."""
    from elaunch.agent.file_timer import FileTimerWatchdog

    rdzv = CountingStandalone()
    timer = FileTimerWatchdog(str(tmp_path / "timer.fifo"))
    monitor = GroupMonitor(rdzv, JobView(rdzv, 0), AgentEvents(None, "", "host", 0), interval=30.0,
                           watchdogs=[timer])
    try:
        began = time.monotonic()
        verdict = run_one(monitor, 0, [sys.executable, "-c", TIMED], timer.env(0))
        took = time.monotonic() - began
    finally:
        timer.close()
    # the worker died of the timer's SIGKILL and its exit failed the group: no alarm of a failed group
    assert verdict is Verdict.FAILED and monitor.alarm is None
    assert took < 15, took  # its 0.5 s scope plus its start, not the monitor's 30 s


class _RaisedOnce:
    """A watchdog whose first look finds a "raised" (in-process restart's alarm: a worker's main() raised)."""

    polls, interval = True, None

    def env(self, local_rank):
        return {}

    def new_attempt(self, round):
        pass

    def poll(self, watched):
        from elaunch.agent.watchdog import Alarm

        return Alarm("raised", {})

    def close(self):
        pass


@pytest.mark.parametrize("nodes_new, verdict", [(1, Verdict.MEMBERSHIP_CHANGE), (0, Verdict.FAILED)])
def test_a_raise_while_new_nodes_joined_is_the_scale_ups_doing(run_one, nodes_new, verdict):
    """A worker that raised while nodes outside the round joined (another node re-formed in process for them and
    closed this worker's connections) is a membership change, not counted, as an exit is then; else a failure."""
    from elaunch.rendezvous.job_channel import InMemoryJobChannel

    channel = InMemoryJobChannel()
    channel.nodes_new = nodes_new

    class Dynamic(CountingStandalone):
        def job_channel(self):
            return channel

    rdzv = Dynamic(reform=True)
    monitor = GroupMonitor(rdzv, JobView(rdzv, 0), AgentEvents(None, "", "host", 0), interval=0.1,
                           watchdogs=[_RaisedOnce()])
    assert run_one(monitor, 30.0) is verdict
    assert monitor.alarm.kind == "raised"
