"""Fixtures for the Slurm tests: a two-node cluster per module, jobs cancelled after each test.

``slurm`` starts :class:`~tests.slurm.cluster.SlurmCluster` once for the module
(about a second) and skips every test, with one line saying why, where Slurm
cannot run (not installed, not root, no network namespaces, a daemon that does
not start). ``jobs`` submits batch scripts and, after the test, cancels what is
still running and waits until no process of those jobs is left on the machine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import FIXTURE_PIDS, REPO, wait_for
from tests.helpers import launcher_env
from tests.slurm import cluster as slurm_cluster

#: Final states of a job (squeue %T); a job that left squeue has one of them too.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node Slurm cluster (``node1``, ``node2``; 2 CPUs each); stopped afterwards."""
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from tests.multinode import netns
    netns.cleanup_stale()
    c = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2, kill_wait=10)
    try:
        c.start(start_timeout=60)
    except slurm_cluster.SlurmError as exc:
        print(exc.details, file=sys.stderr)
        pytest.skip(f"Slurm cannot start here: {exc.summary}")
    FIXTURE_PIDS.update(p.pid for p in c.daemons.values())
    try:
        yield c
    finally:
        c.close()
        FIXTURE_PIDS.difference_update(p.pid for p in c.daemons.values())


class Job:
    """A submitted batch job.

    Attributes:
        id: Slurm's job id (a string).
        out: its output file (``--output``: the batch shell's, srun's and the tasks' stdout and stderr).
    """

    def __init__(self, cluster: slurm_cluster.SlurmCluster, job_id: str, out: Path) -> None:
        self.cluster = cluster
        self.id = job_id
        self.out = out

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def state(self) -> str:
        """squeue's state of the job (``PENDING``, ``RUNNING``, ``COMPLETED``, ...)."""
        return self.cluster.job_state(self.id) or "GONE"

    def describe(self) -> str:
        return f"--- job {self.id} ({self.state()}) output ---\n{self.output[-6000:]}"

    def wait_text(self, text: str, timeout: float, count: int = 1) -> str:
        """Wait until the output holds ``text`` ``count`` times; return the output.

        Raises:
            AssertionError: the job ended first, or ``timeout`` s passed (the output in the message).
        """
        def seen():
            out = self.output
            if out.count(text) >= count:
                return out
            if self.state() in FINAL_STATES | {"GONE"}:
                out = self.output  # the last lines may have landed after the first read
                if out.count(text) >= count:
                    return out
                raise AssertionError(f"job ended before {text!r} x{count} appeared\n{self.describe()}")
            return None
        try:
            return wait_for(seen, timeout, interval=0.2, what=f"{text!r} x{count} in job {self.id}'s output")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def wait_end(self, timeout: float) -> str:
        """Wait until the job is in a final state; return it.

        Raises:
            AssertionError: still not done after ``timeout`` s.
        """
        def done():
            s = self.state()
            return s if s in FINAL_STATES | {"GONE"} else None
        try:
            return wait_for(done, timeout, interval=0.2, what=f"job {self.id} to end")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None


@pytest.fixture
def jobs(slurm, tmp_path):
    """Factory ``submit(script, *args, env=None, sbatch_args=())`` -> Job, run from the repo's root.

    The job gets elaunch from this interpreter's bin directory first on ``PATH`` and
    this checkout on ``PYTHONPATH``; ``RUN_DIR`` (checkpoints) and the output file
    are in ``tmp_path``. After the test every job still running is cancelled and
    the test waits (up to 60 s) until no process of any of them is left.
    """
    submitted: list[Job] = []

    def submit(script: str | Path, *args: str, env: dict | None = None, sbatch_args=()) -> Job:
        out = tmp_path / f"job-{len(submitted)}.out"
        job_env = launcher_env(
            SLURM_CONF=str(slurm.conf), RUN_DIR=str(tmp_path / "run"), PYTHONUNBUFFERED="1",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            **(env or {}))
        res = slurm.client(["sbatch", "--parsable", f"--output={out}", *sbatch_args, str(script), *args],
                           env=job_env, cwd=REPO)
        job = Job(slurm, res.stdout.strip().split(";")[0], out)
        submitted.append(job)
        return job

    yield submit
    running = [j.id for j in submitted if j.state() not in FINAL_STATES | {"GONE"}]
    if running:
        slurm.client(["scancel", *running], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and left_behind(slurm, submitted):
        time.sleep(0.2)
    for pid in left_behind(slurm, submitted):  # the test failed already; keep the next one clean
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def left_behind(slurm: slurm_cluster.SlurmCluster, submitted) -> dict[int, str]:
    """Processes of ``submitted`` jobs anywhere on the machine, and any process in the node hosts but slurmd."""
    found = {}
    for job in submitted:
        found.update(slurm_cluster.stray_job_processes(job.id))
    for pid in slurm.node_pids():
        try:
            found.setdefault(pid, " ".join(psutil.Process(pid).cmdline())[:200])
        except psutil.Error:
            pass
    return found


def assert_nothing_left(slurm: slurm_cluster.SlurmCluster, submitted, timeout: float) -> None:
    """Wait up to ``timeout`` s until :func:`left_behind` is empty.

    Raises:
        AssertionError: processes are still there (pid -> command line in the message).
    """
    deadline = time.monotonic() + timeout
    while (left := left_behind(slurm, submitted)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after the job ended: {left}"
