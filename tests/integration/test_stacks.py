"""dump_stacks on real processes: py-spy, py-spy on a SIGSTOPped process, the faulthandler
fallback, and the cases where neither can help; group_identical as a table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elaunch.procs.progress_files import ProgressFiles
from elaunch.procs.stacks import (
    FAULTHANDLER,
    PY_SPY,
    UNAVAILABLE,
    dump_stacks,
    find_py_spy,
    group_identical,
    normalise_stacks,
)
from tests.conftest import wait_for
from tests.helpers import all_threads_stopped, alive, kill_tree

MARKER = "elaunch_test_blocked_here"
WORKER = textwrap.dedent(
    f"""
    import sys, threading, time
    import elaunch

    def {MARKER}():
        if sys.argv[1] == "report":
            elaunch.progress()
        threading.Event().wait()

    threading.Thread(target=lambda: threading.Event().wait(), daemon=True, name="side").start()
    {MARKER}()
    """
)

needs_py_spy = pytest.mark.skipif(find_py_spy() is None, reason="py-spy not installed")


@pytest.fixture
def files(tmp_path):
    with ProgressFiles(range(2), base_dir=str(tmp_path)) as f:
        yield f


@pytest.fixture
def spawn(tmp_path, files):
    """Start workers (``spawn(rank, report=True)``); every one is killed at teardown."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs: list[subprocess.Popen] = []
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELAUNCH_")}

    def start(rank: int, report: bool = True) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(script), "report" if report else "silent"],
            env={**base, **files.env(rank)}, stdin=subprocess.DEVNULL,
        )
        procs.append(proc)
        if report:
            wait_for(lambda: files.read()[rank] > 0, 30, what=f"rank {rank} to call progress()")
        return proc

    yield start
    for proc in procs:
        kill_tree(proc.pid)
        proc.wait(10)


@needs_py_spy
def test_py_spy_dumps_every_rank_in_parallel(spawn, files):
    procs = {rank: spawn(rank) for rank in (0, 1)}
    dumps = dump_stacks({r: p.pid for r, p in procs.items()}, files.stacks_files(), timeout=20)
    assert set(dumps) == {0, 1}
    for rank, dump in dumps.items():
        assert dump.method == PY_SPY, dump.reason
        assert MARKER in dump.text and dump.reason == ""
        assert f"Process {procs[rank].pid}" in dump.text
    groups = group_identical({f"rank{r}": d.text for r, d in dumps.items()})
    assert [labels for _, labels in groups] == [["rank0", "rank1"]]
    assert all(alive(p.pid) for p in procs.values())


@needs_py_spy
def test_py_spy_reads_a_sigstopped_process(spawn, files):
    proc = spawn(0)
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: all_threads_stopped(proc.pid), 10, what="worker to stop")
    dumps = dump_stacks({0: proc.pid}, files.stacks_files(), timeout=20)
    assert dumps[0].method == PY_SPY, dumps[0].reason
    assert MARKER in dumps[0].text
    assert all_threads_stopped(proc.pid), "dumping must leave a stopped process stopped"
    os.kill(proc.pid, signal.SIGCONT)
    wait_for(lambda: not all_threads_stopped(proc.pid), 10, what="worker to continue")
    assert alive(proc.pid)


def test_faulthandler_fallback_when_py_spy_is_missing(spawn, files, tmp_path):
    procs = {rank: spawn(rank) for rank in (0, 1)}
    missing = str(tmp_path / "no-py-spy")
    dumps = dump_stacks({r: p.pid for r, p in procs.items()}, files.stacks_files(), timeout=20, py_spy=missing)
    for dump in dumps.values():
        assert dump.method == FAULTHANDLER
        assert f"py-spy not found at {missing!r}" in dump.reason
        assert f" in {MARKER}" in dump.text and "elaunch-stacks" not in dump.text
    groups = group_identical({f"rank{r}": d.text for r, d in dumps.items()})
    assert [labels for _, labels in groups] == [["rank0", "rank1"]]
    # A second request returns only the new dump, not the first one again.
    again = dump_stacks({0: procs[0].pid}, files.stacks_files(), timeout=20, py_spy=missing)
    assert again[0].method == FAULTHANDLER and again[0].text.count(MARKER) == 1
    assert all(alive(p.pid) for p in procs.values())


def test_py_spy_overrun_is_killed_and_falls_back(spawn, files, tmp_path):
    """A py-spy that hangs (a stand-in script) is killed at the timeout; faulthandler answers."""
    fake = tmp_path / "hung-py-spy"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    proc = spawn(0)
    t0 = time.monotonic()
    dumps = dump_stacks({0: proc.pid}, files.stacks_files(), timeout=1.0, py_spy=str(fake))
    assert time.monotonic() - t0 < 10
    assert dumps[0].method == FAULTHANDLER
    assert "overran 1 s and was killed" in dumps[0].reason
    assert MARKER in dumps[0].text


def test_no_handler_means_no_signal(spawn, files, tmp_path):
    """A worker that never called progress() is not sent the (otherwise fatal) signal."""
    proc = spawn(0, report=False)
    dumps = dump_stacks({0: proc.pid}, files.stacks_files(), timeout=2, py_spy=str(tmp_path / "none"))
    assert dumps[0].method == UNAVAILABLE and dumps[0].text == ""
    assert f"pid {proc.pid} never called elaunch.progress()" in dumps[0].reason
    with pytest.raises(subprocess.TimeoutExpired):  # a stray signal would kill it at once
        proc.wait(0.5)


def test_stopped_process_without_py_spy_is_unavailable(spawn, files, tmp_path):
    proc = spawn(0)
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: all_threads_stopped(proc.pid), 10, what="worker to stop")
    dumps = dump_stacks({0: proc.pid}, files.stacks_files(), timeout=2, py_spy=str(tmp_path / "none"))
    assert dumps[0].method == UNAVAILABLE
    assert "is stopped and cannot run its signal handler" in dumps[0].reason
    os.kill(proc.pid, signal.SIGCONT)
    assert alive(proc.pid)


@needs_py_spy
def test_not_a_python_process(files):
    proc = subprocess.Popen(["sleep", "600"])
    try:
        dumps = dump_stacks({0: proc.pid}, files.stacks_files(), timeout=20)
        assert dumps[0].method == UNAVAILABLE
        assert dumps[0].reason.startswith("py-spy exited")
        assert "never called elaunch.progress()" in dumps[0].reason
    finally:
        proc.kill()
        proc.wait(10)


def test_no_stacks_files_disables_the_fallback(spawn, tmp_path):
    proc = spawn(0)
    dumps = dump_stacks({0: proc.pid}, None, timeout=2, py_spy=str(tmp_path / "none"))
    assert dumps[0].method == UNAVAILABLE and "no stacks file" in dumps[0].reason


PY_SPY_A = """Process 4242: /usr/bin/python train.py --lr 1
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    wait (threading.py:320)
    allreduce (train.py:12)
Thread 0x7F3A2B1C0700 (active+gil): "loader"
    fetch (data.py:5)
"""
PY_SPY_B = PY_SPY_A.replace("4242", "5151").replace("0x7F3A2B1C0700 (active+gil)", "0x7F00DEADBEEF (idle)")
PY_SPY_C = PY_SPY_B.replace("allreduce (train.py:12)", "load_batch (train.py:30)")
FH_A = """Thread 0x00007f1e2c9ff6c0 (most recent call first):
  File "/app/train.py", line 12 in allreduce

Current thread 0x00007f1e3a1b2b80 (most recent call first):
  File "/app/train.py", line 40 in main
"""
FH_B = """Current thread 0x00007f99aaaa0000 (most recent call first):
  File "/app/train.py", line 12 in allreduce

Thread 0x00007f99bbbb0000 (most recent call first):
  File "/app/train.py", line 40 in main
"""
GROUP_CASES = {
    "pids, thread ids and thread states differ": ({"r0": PY_SPY_A, "r1": PY_SPY_B}, [["r0", "r1"]]),
    "one rank elsewhere": ({"r0": PY_SPY_A, "r1": PY_SPY_C, "r2": PY_SPY_B}, [["r0", "r2"], ["r1"]]),
    "faulthandler: which thread is 'current' does not matter": ({"a": FH_A, "b": FH_B}, [["a", "b"]]),
    "unavailable ranks group together": ({"r0": "", "r1": PY_SPY_A, "r2": ""}, [["r0", "r2"], ["r1"]]),
    "object addresses differ": ({"x": "  f (<lambda> at 0x7f01)\n", "y": "  f (<lambda> at 0x7f99)\n"}, [["x", "y"]]),
    "empty input": ({}, []),
}


@pytest.mark.parametrize("dumps, labels", GROUP_CASES.values(), ids=GROUP_CASES.keys())
def test_group_identical(dumps, labels):
    groups = group_identical(dumps)
    assert [g[1] for g in groups] == labels
    for text, members in groups:
        assert all(normalise_stacks(dumps[m]) == text for m in members)


def test_normalise_stacks():
    assert normalise_stacks(PY_SPY_A) == (
        'Thread <tid>: "MainThread"\n    wait (threading.py:320)\n    allreduce (train.py:12)\n'
        'Thread <tid>: "loader"\n    fetch (data.py:5)'
    )
    assert normalise_stacks(FH_A).splitlines()[0] == "Thread <tid>:"
