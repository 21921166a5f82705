"""The agent's supervisor with real processes: a worker forked from the agent holds no helper's channel."""

from __future__ import annotations

import os

from elaunch.agent.events import EventLog
from elaunch.agent.node_check import NodeCheck
from elaunch.procs import LogsSpec, WorkerLauncher
from elaunch.procs.spawn import is_subreaper, stop_being_subreaper
from elaunch.supervision import SERVICES
from elaunch.rendezvous.job_channel import InMemoryJobChannel
from tests.conftest import wait_for

#: A node-check child that waits for its round's facts until end of file on its channel.
WAITS = "import socket, sys\nsocket.socket(fileno=int(sys.argv[1])).recv(1)\n"


def _holds(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def test_a_forked_worker_does_not_hold_the_channel_of_a_waiting_node_check_child(tmp_path):
    """A round of the nodes already checked leaves the child for the next check waiting while the workers run
    (``NodeCheck.run``): registered with the supervisor, its channel is closed in every forked worker, so the
    agent's end of file still reaches it."""
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    channel = InMemoryJobChannel("n0")
    check = NodeCheck(2.0, False, 1, lambda: channel, EventLog(None, "n0", "h"), script=str(script))
    seen: dict[str, int] = {}
    launcher = WorkerLauncher(LogsSpec(log_dir=str(tmp_path / "logs")), "sup",
                              fork_target=lambda lr: 3 if _holds(seen["fd"], seen["inode"]) else 0)
    subreaper = is_subreaper()
    launcher.open()
    try:
        launcher.supervisor.add(check, SERVICES, watched=False)
        check.prepare()
        [seen["fd"]] = check.private_fds()
        seen["inode"] = os.fstat(seen["fd"]).st_ino
        procs = launcher.start(0, launcher.attempt_logs(0, 1), {0: ["unused"]}, {0: dict(os.environ)}, {}, False)
        codes = wait_for(lambda: (c := procs.poll())[0] is not None and c, 30, what="the forked worker")
        procs.close()
        assert codes == {0: 0}  # 3: the worker held the node check's channel
        child = check._child
        assert child is not None and child.poll() is None  # still waiting for the next check
    finally:
        launcher.close()
        if not subreaper:  # the workers' start made this process one, as it does the agent's (launch.py undoes it)
            stop_being_subreaper()
    assert check._child is None  # the supervisor stopped it
    assert launcher.reaper is None
