"""The main job: examples/ddp_digits.py under elaunch reaches its accuracy, also through a crash.

Also: resumed runs end bit-identical to an uninterrupted one (``--final-params``
digests), and the example's answer to SIGUSR1 (checkpoint, continue) and SIGTERM
(checkpoint, die of SIGTERM, resume on restart).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.conftest import EXAMPLES, wait_for
from tests.integration.conftest import EXAMPLE, SHORT, final_digest
from tests.helpers import kill_tree, run, start

pytestmark = pytest.mark.slow


def _final_accuracy(stdout: str) -> float:
    found = re.findall(r"^final test accuracy: (\d\.\d+)$", stdout, re.M)
    assert len(found) == 1, stdout
    return float(found[0])


def test_example_trains_to_accuracy(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", str(EXAMPLES / "ddp_digits.py"),
            "--checkpoint", str(tmp_path / "ck.pt"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _final_accuracy(r.stdout) >= 0.95
    assert len(re.findall(r"^epoch \d+/\d+ ", r.stdout, re.M)) >= 5


@pytest.mark.long  # in the long part: the suite stays under its 20 minutes
def test_example_recovers_from_a_crashed_rank(tmp_path):
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            str(EXAMPLES / "ddp_digits.py"), "--checkpoint", str(tmp_path / "ck.pt"),
            "--crash-rank", "1", "--crash-epoch", "4", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker group failed (rank 1" in r.stderr
    resumed = re.findall(r"^resumed from .* after epoch (\d+)$", r.stdout, re.M)
    assert resumed and int(resumed[-1]) >= 3, r.stdout  # not from scratch
    assert re.search(r"^epoch \d+/\d+ .* restart 1$", r.stdout, re.M)
    assert _final_accuracy(r.stdout) >= 0.95


# ---- deterministic resume, preemption notices ----
# A short run (3 epochs of 23 steps per rank at world size 2) so that many attempts fit.

#: What the example imports that costs (torch, the optimizer's torch._dynamo, scikit-learn): a warm spare's modules.
WARM_EXAMPLE = "torch,torch._dynamo,sklearn.datasets,sklearn.model_selection,sklearn.preprocessing"
#: attempt k crashes rank R before step S of epoch E: mid-epoch (resumed from a
#: --save-every checkpoint), at an epoch start, on either rank, all at different points
CRASHES = "1:1:7,0:1:19,1:2:3,0:2:12,1:3:0,0:3:21"


@pytest.mark.long  # in the long part: the suite stays under its 20 minutes
def test_six_crashes_end_bit_identical_to_an_uninterrupted_run(tmp_path, reference_digest):
    """From the disk checkpoint (snapshots off): mid-epoch and epoch-boundary resumes (warm restarts)."""
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=6", "--warm-start",
            f"--warm-start-modules={WARM_EXAMPLE}", EXAMPLE, *SHORT,
            "--checkpoint", str(tmp_path / "ck.pt"), "--final-params", str(tmp_path / "final.json"),
            "--save-every", "5", "--snapshot-every", "0", "--crash-at", CRASHES, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"injected crash: rank \d at epoch \d step \d+ on attempt \d", r.stderr)) >= 6
    assert re.search(r"restart 6/6", r.stderr), r.stderr[-3000:]
    resumed = re.findall(r"resumed from .* (at epoch \d step \d+|after epoch \d)$", r.stdout, re.M)
    assert "at epoch 1 step 5" in resumed and "after epoch 2" in resumed, r.stdout  # mid-epoch and boundary
    assert final_digest(tmp_path / "final.json") == reference_digest


@pytest.mark.long  # in the long part: the suite stays under its 20 minutes
def test_six_crashes_lose_no_step_with_snapshots_and_end_bit_identical(tmp_path, reference_digest):
    """With in-memory snapshots (ckpt.save every step, the default under elaunch) and no disk
    checkpoint, each restart resumes at the very step its crash interrupted."""
    # warm restarts (spares with the example's imports done), as a job that restarts often would run:
    # the snapshot restore and bit-identity hold for workers handed to spares too
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=6", "--warm-start",
            f"--warm-start-modules={WARM_EXAMPLE}", EXAMPLE, *SHORT,
            "--no-disk-checkpoint", "--run-dir", str(tmp_path), "--final-params", str(tmp_path / "final.json"),
            "--crash-at", CRASHES, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"restart 6/6", r.stderr), r.stderr[-3000:]
    steps = [int(n) for n in re.findall(r"^resumed from snapshot of step (\d+) ", r.stdout, re.M)]
    per_epoch = 23  # steps per rank and epoch at world size 2
    crashed_at = [(e - 1) * per_epoch + st for _, e, st in (map(int, c.split(":")) for c in CRASHES.split(","))]
    assert steps == crashed_at, r.stdout
    assert final_digest(tmp_path / "final.json") == reference_digest


def test_three_raises_restart_in_process_lose_no_step_and_end_bit_identical(tmp_path, reference_digest):
    """--in-process (elaunch.restartable): each injected crash (a raise) restarts both ranks in their own
    processes, at the very step it interrupted, and the end is bit-identical to an uninterrupted run."""
    crashes = ",".join(CRASHES.split(",")[:3])  # mid-epoch on either rank, and the second epoch
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=3", EXAMPLE, *SHORT, "--in-process",
            "--no-disk-checkpoint", "--run-dir", str(tmp_path), "--final-params", str(tmp_path / "final.json"),
            "--crash-at", crashes, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"restart 3/3", r.stderr), r.stderr[-3000:]
    assert len(re.findall(r"in-process restart: 2 worker\(s\) kept their processes, 0 started", r.stderr)) == 3
    steps = [int(n) for n in re.findall(r"^resumed from snapshot of step (\d+) ", r.stdout, re.M)]
    per_epoch = 23  # steps per rank and epoch at world size 2
    crashed_at = [(e - 1) * per_epoch + st for _, e, st in (map(int, c.split(":")) for c in crashes.split(","))]
    assert steps == crashed_at, r.stdout
    assert final_digest(tmp_path / "final.json") == reference_digest


class _Launch:
    """A background ``elaunch`` whose stdout lines are collected by a thread (use via ``launch``)."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.err = open(tmp_path / "stderr.txt", "w+")
        self.proc = start("elaunch", *args, stderr=self.err)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        found = lambda: next((m for m in map(re.compile(pattern).search, list(self.lines)) if m), None)  # noqa: E731
        try:
            return wait_for(found, timeout, interval=0.05, what=f"a line matching {pattern!r}")
        except AssertionError:
            self.close()
            raise AssertionError(f"no line matching {pattern!r}\nstdout:\n" + "\n".join(self.lines)
                                 + f"\nstderr:\n{self.stderr()[-3000:]}") from None

    def worker(self, rank: int) -> psutil.Process:
        """The worker process whose RANK is ``rank``."""
        def find():
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if "ddp_digits.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                        return p
                except psutil.Error:
                    pass
            return None
        return wait_for(find, 10, what=f"the rank {rank} worker")

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"elaunch did not finish in {timeout}s\nstdout:\n" + "\n".join(self.lines)
                                 + f"\nstderr:\n{self.stderr()[-3000:]}") from None
        self._reader.join(10)
        return code

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def close(self) -> None:
        """Kill the launcher's tree if still running; idempotent."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait(10)
        self._reader.join(10)


@pytest.fixture
def launch(tmp_path):
    """Start background launchers; whatever a test leaves running is killed at teardown."""
    jobs: list[_Launch] = []

    def start_job(*args: str) -> _Launch:
        jobs.append(_Launch(tmp_path, *args))
        return jobs[-1]

    yield start_job
    for job in jobs:
        job.close()
        job.err.close()


def test_sigusr1_to_a_worker_saves_a_checkpoint_and_training_continues(tmp_path, reference_digest, launch):
    # rank 1 gets the notice: every rank agrees on the step, rank 0 saves; results are unchanged
    job = launch("--standalone", "--nproc-per-node=2", EXAMPLE, *SHORT, "--step-sleep", "0.05",
                  "--checkpoint", str(tmp_path / "ck.pt"), "--final-params", str(tmp_path / "final.json"))
    job.wait_line(r"epoch 1/3 ", timeout=60)
    job.worker(1).send_signal(signal.SIGUSR1)
    saved = job.wait_line(r"preemption notice \(SIGUSR1\): checkpoint saved at epoch (\d) step (\d+)$", timeout=30)
    assert (int(saved[1]), int(saved[2])) > (1, 0)
    assert job.finish(timeout=60) == 0, job.stderr()[-3000:]
    assert re.search(r"^final test accuracy: \d\.\d+$", "\n".join(job.lines), re.M), job.lines
    assert "worker group failed" not in job.stderr()
    assert final_digest(tmp_path / "final.json") == reference_digest


@pytest.mark.long  # in the long part: the suite stays under its 20 minutes
def test_sigterm_to_a_worker_saves_stops_and_the_restart_resumes_from_that_step(tmp_path, reference_digest, launch):
    # the workers die of SIGTERM after saving (a stop, not a success): the launcher counts a
    # failure, and the restarted group resumes at the saved step with the same final parameters
    job = launch("--standalone", "--nproc-per-node=2", "--max-restarts=1", EXAMPLE, *SHORT,
                  "--step-sleep", "0.05", "--checkpoint", str(tmp_path / "ck.pt"),
                  "--final-params", str(tmp_path / "final.json"))
    job.wait_line(r"epoch 1/3 ", timeout=60)
    job.worker(1).send_signal(signal.SIGTERM)
    saved = job.wait_line(r"preemption notice \(SIGTERM\): checkpoint saved at epoch (\d) step (\d+)$", timeout=30)
    assert job.finish(timeout=90) == 0, job.stderr()[-3000:]
    failed = re.search(r"worker group failed \(rank \d on \S+, exitcode -15\b[^)]*\); restart 1/1", job.stderr())
    assert failed, job.stderr()[-3000:]
    out = "\n".join(job.lines)
    resume = f"at epoch {saved[1]} step {saved[2]}" if saved[2] != "0" else f"after epoch {int(saved[1]) - 1}"
    assert re.search(rf"^resumed from .* {resume}$", out, re.M), out
    assert final_digest(tmp_path / "final.json") == reference_digest


_FAILING = """
import atexit, os, signal, sys, time
sys.path.insert(0, {examples!r})
from ddp_digits import Notices
notices = Notices(stop_grace=60.0)
notices.install()
if {stop_first}:
    os.kill(os.getpid(), signal.SIGTERM)  # a stop arrives first: noted for the next step boundary
atexit.register(lambda: (print("tearing down", flush=True), time.sleep(60)))  # a slow teardown
try:
    raise RuntimeError("a peer died in the all-reduce")
except BaseException:
    notices.failing()
    raise
"""


@pytest.mark.parametrize("stop_first", [False, True])
def test_a_failing_rank_dies_of_a_stop_at_once(stop_first):
    """A rank whose training loop raised has nothing left to save: a SIGTERM received before the failure
    ends it at the failure, one received during its (slow) teardown ends it then; never after
    --stop-grace or the teardown."""
    proc = subprocess.Popen([sys.executable, "-c", _FAILING.format(examples=str(EXAMPLES), stop_first=stop_first)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if not stop_first:
            assert proc.stdout.readline() == "tearing down\n", proc.stderr.read()
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        kill_tree(proc.pid)
        proc.communicate()
