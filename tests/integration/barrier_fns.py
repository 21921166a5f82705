"""Workers of test_return_barrier: a script (``--run-path``) and a function (``elastic_launch``).

Every local rank but the last returns at once. The last one watches local rank 0:
it waits (with a deadline) until rank 0 is either blocked in ``flock`` on a
sibling's lock (a ``->`` line of ``/proc/locks`` with its pid) or gone, and prints
``rank0 waited`` or ``rank0 exited``. Then it acts on ``MODE``: ``return``, ``fail``
(exit 1), ``kill`` (SIGKILL itself), ``exit0`` (``os._exit(0)``: gone without
returning) or ``hold`` (write ``ready`` in the output directory, then wait for a
signal). Stdlib only; run as a script, ``sys.argv[1]`` is the output directory and
``sys.argv[2]`` the mode.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: Seconds the watching rank waits for rank 0 to block or exit.
DEADLINE = 60.0


def blocked_in_flock(pid: int) -> bool:
    """Whether ``pid`` waits for a ``flock`` (a blocked request in ``/proc/locks``)."""
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and "FLOCK" in fields:
                at = fields.index("->")
                if fields[at + 4] == str(pid):  # "N: -> FLOCK ADVISORY READ PID ..."
                    return True
    return False


def gone(pid: int) -> bool:
    """Whether ``pid`` exited (no such process, or a zombie its agent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {DEADLINE} s")
        time.sleep(0.01)


def work(out_dir: str, mode: str = "return") -> int:
    """The worker (see the module docstring); returns its local rank."""
    lr, n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    with open(os.path.join(out_dir, f"pid_{lr}"), "w") as f:
        f.write(str(os.getpid()))
    print(f"rank{lr} sees the barrier variable: {'ELAUNCH_RETURN_BARRIER' in os.environ}", flush=True)
    if lr != n - 1 or n == 1:
        return lr
    pid0 = os.path.join(out_dir, "pid_0")
    _wait_for(lambda: os.path.exists(pid0) and os.path.getsize(pid0) > 0, "pid of rank 0")
    with open(pid0) as f:
        pid = int(f.read())
    _wait_for(lambda: blocked_in_flock(pid) or gone(pid), "wait or exit of rank 0")
    print("rank0 exited" if gone(pid) else "rank0 waited", flush=True)
    if mode == "fail":
        sys.exit(1)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit0":
        sys.stdout.flush()
        os._exit(0)
    if mode == "hold":  # until killed: the test kills the agent now
        with open(os.path.join(out_dir, "ready"), "w"):
            pass
        while True:
            signal.pause()
    return lr


if __name__ == "__main__":
    work(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "return")
