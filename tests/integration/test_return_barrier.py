"""Function workers that returned wait for their local siblings, as under torchrun (issue 35, item 2).

torch runs ``--run-path`` scripts and ``elastic_launch`` callables under
``MultiprocessContext``, where a worker that returned waits until every worker
returned. Here: local rank 0 returns at once and the last rank checks, in the
kernel's lock table, that rank 0 is blocked waiting rather than gone
(``barrier_fns``); a sibling's failure or death still ends the job at once, a
sibling leaving without returning never hangs it, and one worker alone, or a
script run without elaunch, never waits.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import track_processes, wait_for
from tests.helpers import alive, kill_tree, launcher_env, read_pids, run, start

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("barrier_fns.py"))
NPROC = 3


def _pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid_*"))]


def _no_worker_left(out: Path) -> None:
    left = [pid for pid in _pids(out) if alive(pid)]
    assert not left, f"workers still alive after the launcher returned: {left}"


def _launch(out: Path, mode: str, *flags: str) -> subprocess.CompletedProcess:
    return run("elaunch", f"--nproc-per-node={NPROC}", "--monitor-interval=0.1", *flags, "--run-path",
               WORKER, str(out), mode, timeout=120)


@pytest.mark.parametrize("flags", [(), ("--warm-start",)], ids=["cold", "warm"])
def test_a_run_path_worker_that_returned_waits_for_its_siblings(tmp_path, flags):
    r = _launch(tmp_path, "return", *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank0 waited" in r.stdout, r.stdout + r.stderr
    assert "sees the barrier variable: True" not in r.stdout  # the script's environment is torchrun's
    _no_worker_left(tmp_path)


@pytest.mark.parametrize("mode", ["fail", "kill"])
def test_a_failing_sibling_still_stops_the_waiting_workers_at_once(tmp_path, mode):
    r = _launch(tmp_path, mode)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "rank0 waited" in r.stdout, out
    last = NPROC - 1
    assert f"rank      : {last} (local_rank: {last})" in out, out  # the root cause: the failed rank alone
    assert f"exitcode  : {1 if mode == 'fail' else -9}" in out and "<NO_OTHER_FAILURES>" in out, out
    _no_worker_left(tmp_path)


def test_a_sibling_gone_without_returning_does_not_hang_the_others(tmp_path):
    r = _launch(tmp_path, "exit0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank0 waited" in r.stdout
    _no_worker_left(tmp_path)


def test_a_warm_spare_of_a_restart_holds_its_lock_from_the_start(tmp_path):
    """Attempt 0 fails after rank 0 blocked; attempt 1 runs in warm spares (a template's forks)."""
    script = tmp_path / "restart_once.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        sys.stdout.write("warm %s\\n" % ("torch" in sys.modules))
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        out = os.path.join(sys.argv[1], attempt)
        os.makedirs(out, exist_ok=True)
        sys.path.insert(0, os.path.dirname(sys.argv[2]))
        import barrier_fns
        barrier_fns.work(out, "fail" if attempt == "0" else "return")
    """))
    r = run("elaunch", f"--nproc-per-node={NPROC}", "--monitor-interval=0.1", "--max-restarts=1", "--warm-start",
            "--run-path", str(script), str(tmp_path), WORKER, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert r.stdout.count("rank0 waited") == 2, out
    assert r.stdout.count("warm True") == 2 * NPROC, out
    for attempt in ("0", "1"):
        _no_worker_left(tmp_path / attempt)


def _barrier_dirs(agent_pid: int) -> list[str]:
    """The barrier directories of the agent ``agent_pid``, in ``/dev/shm`` and the temporary directory."""
    return [path for root in ("/dev/shm", tempfile.gettempdir())
            for path in glob.glob(os.path.join(root, f"elaunch-barrier-*-{agent_pid}"))]


def test_a_kill_9_of_the_agent_leaves_no_barrier_directory(tmp_path):
    """The agent dies while rank 0 waits in the barrier: its watchdog kills the workers and removes the files."""
    agent = start("elaunch", f"--nproc-per-node={NPROC}", "--monitor-interval=0.1", "--run-path", WORKER,
                  str(tmp_path), "hold", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        every_pid = lambda: all(p.stat().st_size for p in tmp_path.glob("pid_*")) and len(_pids(tmp_path)) == NPROC
        wait_for(lambda: ((tmp_path / "ready").exists() and every_pid()) or agent.poll() is not None, 60,
                 what="rank 0 waiting and every worker's pid")
        assert agent.poll() is None, f"the agent exited with {agent.returncode} before the kill"
        workers = _pids(tmp_path)
        track_processes(workers)  # orphaned by the kill: the leftover check covers them too
        dirs = _barrier_dirs(agent.pid)
        assert len(dirs) == 1 and dirs[0].startswith("/dev/shm/"), dirs  # where the watchdog may remove it
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, what="the workers' end")
        wait_for(lambda: not _barrier_dirs(agent.pid), 30, what=f"the removal of {dirs[0]}")
    finally:
        kill_tree(agent.pid)
        agent.wait()


def test_one_worker_alone_gets_no_barrier(tmp_path):
    r = run("elaunch", "--nproc-per-node=1", "--run-path", WORKER, str(tmp_path), "return", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank0 sees the barrier variable: False" in r.stdout


def test_runpath_without_elaunch_runs_the_script_and_never_waits(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import sys; print('hello', sys.argv[1:])\n")
    env = launcher_env(ELAUNCH_RETURN_BARRIER="987:/nonexistent/rank_0")  # a stray copy: no descriptor
    r = subprocess.run([sys.executable, "-m", "elaunch.runpath", str(script), "a"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "hello ['a']" in r.stdout, r.stdout + r.stderr


_FN_LAUNCH = """
import sys
from elaunch.launcher.api import LaunchConfig, elastic_launch
from tests.integration import barrier_fns
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node={nproc}, run_id="barrier", rdzv_backend="c10d",
                      rdzv_endpoint="127.0.0.1:0", start_method=sys.argv[1], monitor_interval=0.1)
print("results", elastic_launch(config, barrier_fns.work)(sys.argv[2], "return"), flush=True)
"""


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_function_worker_that_returned_waits_for_its_siblings(tmp_path, start_method):
    r = subprocess.run([sys.executable, "-c", _FN_LAUNCH.format(nproc=NPROC), start_method, str(tmp_path)],
                       env=launcher_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank0 waited" in r.stdout, r.stdout + r.stderr
    assert f"results {dict((lr, lr) for lr in range(NPROC))}" in r.stdout, r.stdout
    _no_worker_left(tmp_path)
