"""Helpers for tests that run the launcher as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def launcher_cmd(which: str, *args: str) -> list[str]:
    """argv of ``elaunch`` or ``torchrun`` (``which``) with ``args``."""
    module = {"elaunch": "elaunch", "torchrun": "torch.distributed.run"}[which]
    return [sys.executable, "-m", module, *args]


def launcher_env(**extra: str) -> dict[str, str]:
    """A clean environment for a launcher: no PET_/TORCHELASTIC_/rank variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    }
    env.update(extra)
    return env


def run(which: str, *args: str, timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a launcher to completion; on timeout kill its whole tree and fail."""
    proc = subprocess.Popen(
        launcher_cmd(which, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or launcher_env(),
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = tree_stacks(proc.pid)
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{which} {args} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}\n"
                             f"stacks of the launcher's process tree at the timeout:\n{stacks}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(which: str, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """Start a launcher in the background (stdout/stderr to files or pipes via kw)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(launcher_cmd(which, *args), text=True, env=env or launcher_env(), **kw)


def start_agent(backend: str, endpoint: str, *script_args: str, rdzv_id: str = "job", nnodes: str | int = 2,
                conf: str = "last_call_timeout=1,join_timeout=60", nproc_per_node: int = 1,
                monitor_interval: float = 0.1, extra: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    """Start one ``elaunch`` agent of a multi-agent job on loopback (``--local-addr=127.0.0.1``)."""
    return start("elaunch", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-backend={backend}",
                 f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", f"--rdzv-conf={conf}",
                 "--local-addr=127.0.0.1", f"--monitor-interval={monitor_interval}", *extra, *script_args, env=env)


def finish_agents(agents: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, float]]:
    """Wait for every agent (``timeout``: a deadline per agent, not a speed check); kill whatever is left.

    Returns:
        ``(returncode, stderr, time.monotonic() when it was seen exited)`` per agent, in order.
    """
    results = []
    try:
        for a in agents:
            _out, err = a.communicate(timeout=timeout)
            results.append((a.returncode, err, time.monotonic()))
    finally:
        for a in agents:
            kill_tree(a.pid)
    return results


def tree_stacks(pid: int, timeout: float = 20) -> str:
    """The Python stacks (``py-spy dump``) of ``pid`` and its descendants, for a timeout's report.

    A process that cannot be read says why; never raises.
    """
    from elaunch.procs.stacks import find_py_spy

    py_spy = find_py_spy()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as exc:
        return f"(no process tree: {exc})"
    if py_spy is None:
        return "(py-spy not found)"
    dumps = []
    for p in procs:
        try:
            head = f"--- pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:200]}"
        except psutil.Error:
            continue
        try:
            r = subprocess.run([py_spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                               timeout=max(1.0, timeout / len(procs)))
            body = r.stdout or r.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            body = f"(py-spy failed: {exc})"
        dumps.append(f"{head}\n{body}")
    return "\n".join(dumps)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def read_pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


#: Variables elaunch gives every worker beyond torchrun's (documented in docs/migrating-from-torchrun.md):
#: the in-memory checkpoints' node directory, the progress file elaunch.progress() writes (and the
#: stacks file and signal of its faulthandler), the in-process restart's control channel. Tests that
#: compare a worker's environment with torchrun's leave these out.
ELAUNCH_ADDED_ENV = frozenset({"ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_PROGRESS_FILE", "ELAUNCH_STACKS_FILE",
                               "ELAUNCH_STACKS_SIGNAL", "ELAUNCH_CONTROL"})


def load_envs(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text())["env"] for p in sorted(out.glob("env_*.json"))}


def all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(states) and all(s in ("T", "t") for s in states)
