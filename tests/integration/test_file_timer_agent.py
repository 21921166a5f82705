"""torch's file timer through a real agent: ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` and a real torch worker.

A worker that holds ``expires(after=1)`` past its deadline is killed by the agent's
timer server (SIGKILL, the client's default); the agent counts that as a worker
failure and restarts the group, and the job still succeeds. Without the variable no
server runs, no timer file is given to the workers, and nothing is killed early.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import wait_for
from tests.helpers import alive, kill_tree, launcher_env, run, start

pytestmark = pytest.mark.slow

#: The worker: on its first attempt, when a timer file is given, it holds a timer of
#: 1 s around a sleep of argv[2] seconds; any later attempt exits 0 at once. It leaves
#: ``start_<attempt>`` (its pid and the timer file it saw), ``armed_<attempt>`` (when the
#: timer was acquired) and ``done_<attempt>`` (it lived to the end) in argv[1].
WORKER = """\
import json, os, sys, time

out, sleep = sys.argv[1], float(sys.argv[2])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
path = os.environ.get("TORCHELASTIC_TIMER_FILE")


def mark(name, **doc):
    with open(os.path.join(out, f"{name}_{attempt}.tmp"), "w") as f:
        json.dump({"t": time.time(), **doc}, f)
    os.replace(os.path.join(out, f"{name}_{attempt}.tmp"), os.path.join(out, f"{name}_{attempt}"))


mark("start", pid=os.getpid(), timer_file=path)
if attempt == "0":
    if path:
        from torch.distributed.elastic.timer import FileTimerClient, configure, expires

        configure(FileTimerClient(path))
        with expires(after=1):
            mark("armed")
            time.sleep(sleep)
    else:
        time.sleep(sleep)
mark("done")
"""


def _read(path):
    return json.loads(path.read_text())


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "timed_worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def test_an_expired_worker_is_killed_by_the_agents_timer_server_and_the_group_restarts(worker, tmp_path):
    script, out = worker
    # TMPDIR: the server's FIFO (<tempdir>/watchdog_timer_<uuid>) lands where the test can see it
    env = launcher_env(TORCHELASTIC_ENABLE_FILE_TIMER="1", TMPDIR=str(tmp_path))
    began = time.monotonic()
    agent = start("elaunch", "--standalone", "--nproc-per-node=1", "--max-restarts=1", str(script), str(out), "60",
                  env=env)
    try:
        armed = wait_for(lambda: (out / "armed_0").exists() and _read(out / "armed_0"), 60,
                         what="the first worker holding its timer")
        first = _read(out / "start_0")
        wait_for(lambda: not alive(first["pid"]), 15, what="the expired worker killed")
        killed_after = time.time() - armed["t"]
        _out, err = agent.communicate(timeout=60)
        elapsed = time.monotonic() - began
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 0, err[-3000:]
    assert killed_after < 10, killed_after  # about 1 s (+ the check interval), not the 60 s sleep
    assert elapsed < 30, (elapsed, err[-3000:])  # well before the first worker's sleep would end
    assert sorted(p.name for p in out.iterdir()) == ["armed_0", "done_1", "start_0", "start_1"]
    # the dead worker was a normal failure: counted, then a second attempt
    assert "exitcode -9 SIGKILL); restart 1/1" in err, err[-3000:]
    timer_file = first["timer_file"]
    assert timer_file and os.path.dirname(timer_file) == str(tmp_path), timer_file
    assert _read(out / "start_1")["timer_file"] == timer_file  # one server for the agent's life
    assert not os.path.exists(timer_file)  # the server removed its FIFO


def test_without_the_variable_no_timer_runs_and_nothing_is_killed_early(worker, tmp_path):
    script, out = worker
    env = launcher_env(TMPDIR=str(tmp_path))
    # were a timer file handed out, the worker would hold a 1 s timer around its 3 s sleep
    res = run("elaunch", "--standalone", "--nproc-per-node=1", "--max-restarts=1", str(script), str(out), "3",
              env=env, timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["done_0", "start_0"]  # one attempt, lived to the end
    assert _read(out / "start_0")["timer_file"] is None
    assert _read(out / "done_0")["t"] - _read(out / "start_0")["t"] >= 3.0
    assert not list(tmp_path.glob("watchdog_timer_*"))
