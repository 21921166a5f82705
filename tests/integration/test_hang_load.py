"""--hang-timeout beside a CPU hog: ranks that call elaunch.progress() are never found hung.

Two busy-loop processes per core run for the whole test, as on a shared machine
running another job. The workers' program ends with a slow interpreter teardown
(``SlowTeardown.__del__``), standing for what torch's and gloo's destructors take on a
loaded machine: on 2 busy cores, over 2 s after the last ``progress()`` of a finished
run, longer than ``--hang-timeout=2`` (issue 22: the faulted example's 4th ``HUNG``).

Attempt 0: rank 1 stops itself (SIGSTOP) after a few steps while rank 0 keeps stepping:
the one injected hang, rank 1 alone. Attempt 1: rank 0 raises, then tears down slowly,
while rank 1 waits for it without progress (a peer blocked in a collective): a crash,
not a hang. Attempt 2: both ranks finish their steps, then tear down slowly: success.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import run

pytestmark = [pytest.mark.slow, pytest.mark.long]

HANG_TIMEOUT = 2.0
WORKER = textwrap.dedent(
    f"""
    import os, signal, sys, time
    import elaunch

    class SlowTeardown:
        def __del__(self):  # runs in the interpreter's teardown, after the exit mark
            time.sleep({3 * HANG_TIMEOUT})

    rank = int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    teardown = SlowTeardown()
    step = 0
    while True:
        step += 1
        elaunch.progress()
        if (attempt, rank, step) == (0, 1, 10):
            print(f"injected hang: rank {{rank}} on attempt {{attempt}}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if (attempt, rank, step) == (1, 0, 10):
            raise RuntimeError(f"injected crash: rank {{rank}} on attempt {{attempt}}")
        if (attempt, rank, step) == (1, 1, 10):
            while True:  # waits for the crashed peer, as in a collective: no progress
                time.sleep(1)
        if step == 40 and (attempt, rank) != (0, 0):  # rank 0 of attempt 0 steps until stopped
            break
        time.sleep(0.05)
    print(f"rank {{rank}} done on attempt {{attempt}}", flush=True)
    """
)


@pytest.fixture
def cpu_hog():
    """Two busy-loop processes per core for the whole test; killed (and reaped) at teardown."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range((os.cpu_count() or 1) * 2)]
    yield hogs
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait(10)


def test_under_load_only_the_injected_hang_is_found(tmp_path, cpu_hog):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = run("elaunch", "--standalone", "--nproc-per-node=2", f"--hang-timeout={HANG_TIMEOUT:g}",
            "--max-restarts=2", "--monitor-interval=0.2", "--log-dir", str(tmp_path / "logs"), str(script),
            timeout=240)
    err = r.stderr
    assert all(hog.poll() is None for hog in cpu_hog), "the CPU hog ran for the whole job"
    assert r.returncode == 0, err[-4000:]
    assert err.count("injected hang: rank 1 on attempt 0") == 1, err[-4000:]
    # exactly the injected hang was found: rank 1 on attempt 0, never rank 0 that kept stepping
    hung = re.findall(r"HUNG: rank (\d) \(local rank \d\) made no progress for ([0-9.]+) s", err)
    assert [rank for rank, _ in hung] == ["1"], err[-4000:]
    assert float(hung[0][1]) >= HANG_TIMEOUT
    [events] = (tmp_path / "logs").rglob("events.jsonl")
    records = [json.loads(line) for line in events.read_text().splitlines()]
    hangs = [(e["round"], e["ranks"]) for e in records if e["kind"] == "hang"]
    assert hangs == [(0, [1])], hangs
    # the crash of attempt 1 is a crash (its peer's quiet behind it is not a hang), then success
    failed = re.findall(r"worker group failed \(rank (\d) on \S+, exitcode (-?\d+)[^)]*\); restart (\d)/2", err)
    assert failed == [("1", "-9", "1"), ("0", "1", "2")], err[-4000:]
    assert sorted(re.findall(r"rank (\d) done on attempt 2", r.stdout)) == ["0", "1"], r.stdout
    assert any(e["kind"] == "job_succeeded" for e in records), records[-3:]


TEARDOWN_DEADLOCK = textwrap.dedent(
    """
    import atexit, os, threading, time

    rank = int(os.environ["LOCAL_RANK"])
    if rank == 1:
        # registered before elaunch's exit mark, so it runs after it (atexit runs last-in, first-out):
        # the program has ended, the worker deadlocks in its teardown
        atexit.register(lambda: threading.Event().wait())
    import elaunch

    for _ in range(5):
        elaunch.progress()
        time.sleep(0.05)
    print(f"rank {rank} program done", flush=True)
    """
)


def test_a_deadlock_in_teardown_is_a_hang_after_the_exit_grace(tmp_path):
    """Exiting exempts a rank from --hang-timeout for max(timeout, 30 s) only: then it is hung while exiting."""
    from elaunch.agent.decide import exit_grace

    script = tmp_path / "worker.py"
    script.write_text(TEARDOWN_DEADLOCK)
    # old code: the exiting rank was never judged, the job never ended (run() fails at its timeout)
    r = run("elaunch", "--standalone", "--nproc-per-node=2", "--hang-timeout=1", "--max-restarts=0",
            "--monitor-interval=0.2", "--log-dir", str(tmp_path / "logs"), str(script), timeout=exit_grace(1) + 90)
    err = r.stderr
    assert r.returncode == 1, err[-4000:]
    assert sorted(re.findall(r"rank (\d) program done", r.stdout)) == ["0", "1"], r.stdout
    found = re.findall(r"HUNG: rank (\d) \(local rank \d\) made no progress for [0-9.]+ s, hung while exiting "
                       r"\(its program ended; its teardown has not finished ([0-9.]+) s later", err)
    assert [rank for rank, _ in found] == ["1"], err[-4000:]
    # within the bound: the grace, then one monitor interval (generous slack for a loaded machine)
    assert exit_grace(1) <= float(found[0][1]) < exit_grace(1) + 20, found
    [events] = (tmp_path / "logs").rglob("events.jsonl")
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["round"], e["ranks"]) for e in records if e["kind"] == "hang"] == [(0, [1])]
