"""A two-agent job for the ``elaunch status`` tests (c10d and etcd), and the status command as a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, finish_agents, launcher_cmd, launcher_env, start_agent

WORKER = SCRIPTS / "status_worker.py"


def start_job(backend: str, endpoint: str, rdzv_id: str, out: Path, conf: str, *, fail_first: bool = False,
              max_restarts: int = 0) -> list[subprocess.Popen]:
    """Start two agents of one job (one worker each) running ``status_worker.py``."""
    extra = ["--fail-first"] if fail_first else []
    return [start_agent(backend, endpoint, str(WORKER), str(out), *extra, rdzv_id=rdzv_id, conf=conf,
                        extra=(f"--max-restarts={max_restarts}",)) for _ in range(2)]


def worker_pids(out: Path, restart: int) -> dict[int, int]:
    """Global rank -> pid of the workers that started in restart ``restart``."""
    return {int(p.name.split("_")[1]): int(p.read_text()) for p in out.glob(f"started_*_{restart}")}


def wait_started(out: Path, restart: int, timeout: float = 90) -> dict[int, int]:
    return wait_for(lambda: len(worker_pids(out, restart)) == 2 and worker_pids(out, restart), timeout,
                    what=f"both workers of restart {restart} started")


def finish(agents: list[subprocess.Popen], out: Path, timeout: float = 90) -> list[tuple[int, str]]:
    """Let the workers exit (the go file) and wait for both agents; kill whatever is left."""
    (out / "go").touch()
    return [(code, err) for code, err, _ in finish_agents(agents, timeout)]


def status(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m elaunch status ARGS`` to completion (``timeout``: a deadline, not a speed check)."""
    proc = subprocess.run(launcher_cmd("elaunch", "status", *args), capture_output=True, text=True,
                          env=launcher_env(), timeout=timeout)
    return proc


def status_json(*args: str) -> dict:
    proc = status(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 1, nothing on stdout, one line on stderr that contains every needle."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
