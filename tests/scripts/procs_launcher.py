"""A tiny launcher for the orphan fault tests: reaper + workers with grandchildren.

Usage: procs_launcher.py TMPDIR [trees|daemon]. Starts the reaper, then the
workers, each with the env entries an agent gives its workers (run id, error
file, ranks), writes "<reaper pid> <worker pids...>" to TMPDIR/launcher.pids and
sleeps until killed. Each worker writes TMPDIR/w<rank>.pid ("<pid> <grandchild pid>").

* ``trees`` (default): 2 sleeping workers, each with a grandchild (rank 0 plain,
  rank 1 in its own session); TMPDIR/ready once both pidfiles exist.
* ``daemon``: 1 worker that double-forks a sleeper into its own session and
  exits; TMPDIR/ready once the worker exited and the sleeper was re-parented to
  this launcher (a child subreaper). From then on the launcher looks at nothing:
  what an agent killed right after adopting the orphan knows of it.
"""

import os
import sys
import time

from elaunch.procs import LogsSpec, RunLogDir, WorkerProcesses, start_reaper

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "procs_worker.py")


def main(tmp, mode="trees"):
    children = (("plain", "--sleep"), ("setsid", "--sleep")) if mode == "trees" else (("daemon", "--exit"),)
    spec = LogsSpec(log_dir=os.path.join(tmp, "logs"))
    logs = RunLogDir(spec, "fault").attempt(0, len(children))
    reaper = start_reaper()
    cmds = {
        lr: [sys.executable, WORKER, "--child", child, "--pidfile", os.path.join(tmp, f"w{lr}.pid"),
             then, "300" if then == "--sleep" else "0"]
        for lr, (child, then) in enumerate(children)
    }
    envs = {lr: dict(os.environ, TORCHELASTIC_RUN_ID="fault", TORCHELASTIC_ERROR_FILE=logs.error_file[lr],
                     RANK=str(lr), LOCAL_RANK=str(lr)) for lr in cmds}
    procs = WorkerProcesses.start(cmds, envs, logs, spec, {}, reaper=reaper)
    with open(os.path.join(tmp, "launcher.pids.tmp"), "w") as f:
        f.write(" ".join(map(str, [reaper.pid, *procs.pids.values()])))
    os.replace(os.path.join(tmp, "launcher.pids.tmp"), os.path.join(tmp, "launcher.pids"))
    for lr in cmds:
        while not os.path.exists(os.path.join(tmp, f"w{lr}.pid")):
            procs.wait(0.02)
    if mode == "daemon":
        while procs.poll()[0] is None:
            procs.wait(1.0)
        with open(os.path.join(tmp, "w0.pid")) as f:
            sleeper = int(f.read().split()[1])
        while _ppid(sleeper) != os.getpid():
            time.sleep(0.01)
    assert reaper.sync(), "reaper did not acknowledge"
    open(os.path.join(tmp, "ready"), "w").close()
    while True:
        time.sleep(1.0)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[1])


if __name__ == "__main__":
    main(*sys.argv[1:])
