"""A tiny launcher for the orphan fault test: reaper + 2 workers with grandchildren.

Usage: procs_launcher.py TMPDIR. Starts the reaper, then 2 workers (each with a
grandchild: rank 0 plain, rank 1 in its own session), writes
"<reaper pid> <worker pids...>" to TMPDIR/launcher.pids and sleeps until killed.
Each worker writes TMPDIR/w<rank>.pid ("<pid> <grandchild pid>"); once both
exist and the reaper has snapshotted the trees, TMPDIR/ready is created.
"""

import os
import sys
import time

from elaunch.procs import LogsSpec, RunLogDir, WorkerProcesses, start_reaper

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "procs_worker.py")


def main(tmp):
    spec = LogsSpec(log_dir=os.path.join(tmp, "logs"))
    logs = RunLogDir(spec, "fault").attempt(0, 2)
    reaper = start_reaper()
    cmds = {
        lr: [sys.executable, WORKER, "--child", mode, "--pidfile", os.path.join(tmp, f"w{lr}.pid"), "--sleep", "300"]
        for lr, mode in ((0, "plain"), (1, "setsid"))
    }
    envs = {lr: dict(os.environ) for lr in cmds}
    procs = WorkerProcesses.start(cmds, envs, logs, spec, {}, reaper=reaper)
    with open(os.path.join(tmp, "launcher.pids.tmp"), "w") as f:
        f.write(" ".join(map(str, [reaper.pid, *procs.pids.values()])))
    os.replace(os.path.join(tmp, "launcher.pids.tmp"), os.path.join(tmp, "launcher.pids"))
    for lr in cmds:
        while not os.path.exists(os.path.join(tmp, f"w{lr}.pid")):
            procs.wait(0.02)
    assert reaper.sync(), "reaper did not acknowledge"
    open(os.path.join(tmp, "ready"), "w").close()
    while True:
        procs.wait(1.0)  # keep snapshotting, as the agent's monitor loop does
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
