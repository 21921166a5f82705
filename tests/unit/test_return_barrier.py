"""elaunch.procs.return_barrier: who waits, and a waiter follows a placeholder replaced by a spare's file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elaunch.procs import return_barrier as rb
from tests.conftest import wait_for
from tests.integration.barrier_fns import blocked_in_flock


@pytest.mark.parametrize("cmd, nproc, forked, expected", [
    (["python", "-u", "-m", "elaunch.runpath", "s.py"], 2, False, True),
    (["python", "-u", "-m", "elaunch.procs._fn_worker", "p", "r"], 4, False, True),
    (["python", "-u", "-m", "elaunch.runpath", "s.py"], 1, False, False),  # alone: never waits
    (["python", "-u", "s.py"], 4, False, False),  # a plain script exits as under torchrun
    (["python", "-u", "-m", "pkg.train"], 4, False, False),
    (["<fork: fn>"], 2, True, True),
    (["<fork: fn>"], 1, True, False),
])
def test_which_workers_wait(cmd, nproc, forked, expected):
    assert rb.applies(cmd, nproc, forked=forked) is expected


def test_claim_takes_the_variable_and_ignores_a_copy_without_its_descriptor(tmp_path):
    env = {rb.ENV: "987654:/nowhere/rank_0"}
    assert rb.claim(env) is None and rb.ENV not in env
    assert rb.claim({}) is None


_WAITER = """
import sys
from elaunch.procs import return_barrier as rb
rb._wait_returned(sys.argv[1])
"""


def test_a_waiter_follows_a_placeholder_replaced_by_a_spares_file(tmp_path):
    barrier = rb.AttemptBarrier(str(tmp_path / "attempt_0"), [0, 1])
    spare_fd, spare_path = rb.spare_lock(str(tmp_path))
    waiter = subprocess.Popen([sys.executable, "-c", _WAITER, barrier.path(1)])
    try:
        wait_for(lambda: blocked_in_flock(waiter.pid), 30, what="the waiter blocked on the placeholder")
        os.replace(spare_path, barrier.path(1))  # the handoff: the spare's held file becomes rank 1's
        barrier.started(1)  # the placeholder's lock goes: the waiter must block again, on the spare's
        wait_for(lambda: blocked_in_flock(waiter.pid) or waiter.poll() is not None, 30, what="the waiter")
        assert waiter.poll() is None, "the waiter took the replaced placeholder for a returned worker"
        os.close(spare_fd)  # the spare's worker returned (or died)
        assert waiter.wait(timeout=30) == 0
    finally:
        barrier.close()
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


_WORKER = """
import sys
from elaunch.procs import return_barrier as rb
held = rb.claim()
open(sys.argv[1], "w").close()  # the function returned
rb.arrive(held)
"""


def test_the_last_worker_to_return_waits_until_the_agent_read_every_return(tmp_path):
    """As torch's ``_wrap``: every worker, the last one too, waits until the agent saw all returns."""
    barrier = rb.AttemptBarrier(str(tmp_path / "attempt_0"), [0, 1])
    workers = []
    try:
        for lr in (0, 1):
            env = {**os.environ, **barrier.env(lr)}
            workers.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"returned_{lr}")],
                                            env=env, pass_fds=(barrier.fd(lr),)))
            barrier.started(lr)
        returned = lambda: all((tmp_path / f"returned_{lr}").exists() for lr in (0, 1))
        wait_for(lambda: (returned() and all(blocked_in_flock(w.pid) for w in workers))
                 or any(w.poll() is not None for w in workers), 30, what="both workers returned and waiting")
        assert [w.poll() for w in workers] == [None, None], "a worker exited before the agent read the returns"
        reader = barrier.read_returns()
        assert [w.wait(timeout=30) for w in workers] == [0, 0]
        reader.join(timeout=30)
        assert not reader.is_alive()
    finally:
        barrier.close()
        barrier.release()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


def test_the_reader_releases_the_workers_when_one_died(tmp_path):
    """A worker killed before it returned drops its lock: the reader still ends and frees the others."""
    barrier = rb.AttemptBarrier(str(tmp_path / "attempt_0"), [0, 1])
    env = {**os.environ, **barrier.env(0)}
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "returned_0")], env=env,
                              pass_fds=(barrier.fd(0),))
    barrier.started(0)
    dead = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], pass_fds=(barrier.fd(1),))
    barrier.started(1)
    try:
        reader = barrier.read_returns()
        wait_for(lambda: blocked_in_flock(worker.pid) or worker.poll() is not None, 30, what="rank 0 waiting")
        assert worker.poll() is None
        dead.kill()
        dead.wait()
        assert worker.wait(timeout=30) == 0
        reader.join(timeout=30)
        assert not reader.is_alive()
    finally:
        barrier.close()
        barrier.release()
        for p in (worker, dead):
            if p.poll() is None:
                p.kill()
                p.wait()
