"""Shared fixtures: every test must leave no process behind.

The autouse ``no_leftover_processes`` fixture snapshots this pytest process's
descendants before a test and, after it, waits (with a deadline) for every new
one to be gone. Survivors are killed and the test fails, naming them.

Under CI (``CI`` set, as ``.ci/run`` is run) a skipped test fails: CI installs every
tool the tests need (etcd, Slurm, py-spy, mkdocs, root for network namespaces), so a
skip there is a broken install hiding a check, not a pass. A test that does not apply
to one of its parameters says so with a reason starting ``n/a:`` (:data:`NOT_APPLICABLE`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate()`` until truthy or ``timeout`` seconds pass; return its value.

    Raises:
        AssertionError: the deadline passed; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _descendants() -> dict[int, str]:
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            out[p.pid] = " ".join(p.cmdline())[:200]
        except psutil.Error:
            pass
    return out


#: Processes a test registered with ``track_processes``: checked like descendants,
#: since ones reparented to init (orphans) are no longer this process's descendants.
_TRACKED: list[psutil.Process] = []


def track_processes(pids) -> None:
    """Have the leftover check cover ``pids`` too (e.g. grandchildren that may be orphaned)."""
    for pid in pids:
        try:
            _TRACKED.append(psutil.Process(pid))  # kill()/is_running() re-check identity (create time)
        except psutil.NoSuchProcess:
            pass


#: Servers that fixtures of a wider scope started (etcd members): not a test's leftovers,
#: even when a function-scoped fixture first asked for them after the snapshot.
FIXTURE_PIDS: set[int] = set()


def _tracked_alive() -> dict[int, str]:
    out = {}
    for p in _TRACKED:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # PID 1 here may not reap zombies
                out[p.pid] = " ".join(p.cmdline())[:200]
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = set(_descendants())
    yield
    def leftovers():
        found = {pid: cmd for pid, cmd in _descendants().items() if pid not in before and pid not in FIXTURE_PIDS}
        found.update(_tracked_alive())
        return found
    deadline = time.monotonic() + 10.0
    left = leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leftovers()
    tracked = {p.pid: p for p in _TRACKED}
    _TRACKED.clear()
    if left:
        for pid in left:
            try:
                (tracked.get(pid) or psutil.Process(pid)).kill()
            except psutil.Error:
                pass
        pytest.fail(f"test left processes behind: {left}")


@pytest.fixture(autouse=True)
def subreaper_flag_left_as_found():
    """No test may leave this (pytest's) process a child subreaper.

    The agent sets the flag while its workers run; in-process launches (the command's
    ``launch`` called from a test) can leave it set. Every orphan of a later test's
    children (the helpers of an agent a test SIGKILLs) then becomes pytest's zombie
    for the rest of the session. The flag is cleared here and the test that left it fails.
    """
    from elaunch.procs.spawn import is_subreaper, stop_being_subreaper

    before = is_subreaper()
    yield
    if is_subreaper() and not before:
        stop_being_subreaper()
        pytest.fail("the test left this process a child subreaper (PR_SET_CHILD_SUBREAPER): "
                    "its later children's orphans would become its zombies")


@pytest.fixture(autouse=True)
def logging_lock_left_free():
    """No test may leave logging's module lock held by this (the main) thread.

    An exception raised by a signal handler inside logging's locked windows (a
    cache fill, its at-fork hooks around a ``Popen`` with ``preexec_fn``) leaks
    the lock: the main thread goes on (the lock is re-entrant), while every other
    thread that logs later blocks forever. A CI run once hung that way in a later
    test's threads. The lock is freed here and the test that left it fails.
    """
    yield
    lock = getattr(logging, "_lock", None)
    held = 0
    while lock is not None and lock._is_owned():
        lock.release()
        held += 1
    if held:
        pytest.fail(f"the test left logging's module lock held ({held}x): other threads that log would block forever")


#: A skip reason starting with this is a case the test does not apply to (not a missing tool).
NOT_APPLICABLE = "n/a:"


def _fail_a_skip_under_ci(report) -> None:
    """Under CI, turn ``report``'s skip for a missing environment into a failure naming the reason."""
    if not (os.environ.get("CI") and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(NOT_APPLICABLE):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where every tool the tests need is installed: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips itself (``pytest.skip``, a fixture's skip, ``skipif``)."""
    _fail_a_skip_under_ci((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module that skips at import (a module-level ``pytest.importorskip``)."""
    _fail_a_skip_under_ci((yield).get_result())


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def clean_env(monkeypatch):
    """An environment without torchrun/elaunch variables leaking in from outside."""
    for key in list(os.environ):
        if key.startswith(("PET_", "TORCHELASTIC_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
            monkeypatch.delenv(key, raising=False)
    return os.environ
