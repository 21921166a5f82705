"""Worker functions for test_launcher_api: module-level, so spawned workers can unpickle them.

Stdlib only, so a spawned elaunch worker imports nothing heavy to load them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: The variables torchrun's agent sets for every worker (compared side by side).
WORKER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "OMP_NUM_THREADS",
)


def rank_scaled(x: int, tag: str) -> tuple[int, str, int]:
    """Return (RANK * x, tag, LOCAL_RANK) of this worker."""
    return int(os.environ["RANK"]) * x, tag, int(os.environ["LOCAL_RANK"])


def fail_on_rank(rank: int, message: str) -> str:
    """Raise ValueError(message) on global rank ``rank``; the others return "ok"."""
    if int(os.environ["RANK"]) == rank:
        raise ValueError(message)
    return "ok"


def fail_first_attempt() -> int:
    """Raise on rank 0 of the first attempt; return TORCHELASTIC_RESTART_COUNT afterwards."""
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if count == 0 and os.environ["RANK"] == "0":
        raise RuntimeError("first attempt fails")
    return count


def term_the_agent() -> None:
    """Rank 0 sends SIGTERM to its parent, the agent; every rank then waits to be stopped."""
    if os.environ["RANK"] == "0":
        os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)


def worker_env() -> dict[str, str | None]:
    """Return the torchrun worker variables as this worker sees them in os.environ."""
    return {key: os.environ.get(key) for key in WORKER_VARS}


def print_rank() -> None:
    """Print one line to stdout and one to stderr, naming the rank."""
    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)


def _write_pids(pid_dir: str, *pids: int) -> None:
    rank = os.environ["RANK"]
    tmp = os.path.join(pid_dir, f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(tmp, os.path.join(pid_dir, f"{rank}.pids"))


def child_then_fail(pid_dir: str) -> None:
    """Every rank starts a ``sleep`` child and records both pids; rank 0 then raises, the others wait.

    Rank 0's child stays in its process group (found by group once rank 0 is gone);
    the others' children leave group and session (``setsid``, as a daemon does) and
    are found as descendants of their running worker. Rank 0 raises once every rank
    wrote its pid file.
    """
    rank = os.environ["RANK"]
    child = subprocess.Popen(["sleep", "300"], start_new_session=rank != "0")
    _write_pids(pid_dir, os.getpid(), child.pid)
    if rank == "0":
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(pid_dir) if n.endswith(".pids")]) < int(os.environ["WORLD_SIZE"]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise RuntimeError("rank 0 fails while the others run")
    time.sleep(300)


def fork_child_then_wait(pid_dir: str, kill_agent: bool = False) -> None:
    """Fork a child that does not exec (as a DataLoader worker), record both pids, wait.

    ``kill_agent``: ``kill -9`` the agent (this worker's parent) at once, while it may
    still be starting the other workers.
    """
    agent = os.getppid()
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    _write_pids(pid_dir, os.getpid(), pid)
    if kill_agent:
        os.kill(agent, signal.SIGKILL)
    time.sleep(300)
