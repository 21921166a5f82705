"""Python stack dumps of running (or hung, or stopped) workers, for hang reports.

Primary tool: ``py-spy dump`` (reads the process's memory through ptrace; the worker
needs no cooperation). It pauses the target while it reads, unless the target is
stopped or in uninterruptible sleep, where pausing would fail or block: those are read
with ``--nonblocking`` (``py-spy`` 0.4 fails with "Failed to suspend process" on a
SIGSTOPped process without it).

Fallback, when py-spy is missing, fails, overruns, or may not ptrace: send the worker
:data:`~elaunch.procs.progress_files.STACKS_SIGNAL`, on which the faulthandler that
:func:`elaunch.progress` registered appends all threads' stacks to the worker's stacks
file. Works only for a worker that called ``elaunch.progress()`` at least once (the
signal's default action would kill any other process, so it is sent only to a pid
that wrote the registration line) and that is not stopped.

Stdlib only; no torch.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .._worker_progress import STACKS_HEADER
from . import _proctree
from .progress_files import STACKS_SIGNAL

__all__ = [
    "FAULTHANDLER",
    "PY_SPY",
    "UNAVAILABLE",
    "StackDump",
    "dump_stacks",
    "find_py_spy",
    "group_identical",
    "normalise_stacks",
]

PY_SPY = "py-spy"
FAULTHANDLER = "faulthandler"
UNAVAILABLE = "unavailable"
#: /proc states in which py-spy must not pause the target: stopped, traced, disk sleep.
_NONBLOCKING_STATES = frozenset("TtD")
#: A faulthandler dump is complete when the file stops growing for this long (seconds).
_SETTLE_S = 0.05
_POLL_S = 0.01


@dataclass(frozen=True)
class StackDump:
    """One process's Python stacks.

    Attributes:
        text: the stack text as the tool printed it; "" when unavailable.
        method: ``"py-spy"``, ``"faulthandler"`` or ``"unavailable"``.
        reason: why the fallback was used (for ``"faulthandler"``) or why there are
            no stacks (for ``"unavailable"``); "" when py-spy succeeded.
    """

    text: str
    method: str
    reason: str = ""


def find_py_spy() -> str | None:
    """Path of the py-spy executable: next to ``sys.executable`` first, then on PATH.

    Cost: one or two ``stat`` calls and a PATH search.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def dump_stacks(
    pids: Mapping[int, int],
    stacks_files: Mapping[int, str] | None = None,
    timeout: float = 10.0,
    *,
    py_spy: str | None = None,
    stacks_signal: int = STACKS_SIGNAL,
) -> dict[int, StackDump]:
    """Dump the Python stacks of several processes in parallel.

    Args:
        pids: local rank -> pid.
        stacks_files: local rank -> the stacks file that rank's worker was given
            (``ProgressFiles.stacks_files()``); None, or a missing rank, disables the
            faulthandler fallback for that rank. The files must belong to the current
            workers (``ProgressFiles.reset()`` or new files after a restart): a line
            left by an earlier worker whose pid was reused would get the signal sent
            to a process without the handler, which kills it.
        timeout: seconds each phase may take: all py-spy runs start together and each
            is killed when it overruns; then the ranks that need the fallback are
            signalled together and waited for, up to ``timeout`` again. So the call
            returns within about ``2 * timeout`` seconds.
        py_spy: the py-spy executable; None looks it up with :func:`find_py_spy`. A
            path that is not an executable file disables py-spy (every rank falls back).
        stacks_signal: the signal the workers registered (``ELAUNCH_STACKS_SIGNAL``).

    Returns:
        Local rank -> :class:`StackDump`, one per entry of ``pids``. Never raises for a
        process that cannot be read; the dump says why in ``reason``.

    Cost: one py-spy process per rank (tens of milliseconds of CPU each, and a pause
    of the target of a few milliseconds while it is read); for a fallback rank, one
    signal and polling of its stacks file every 10 ms until it settles.
    """
    if py_spy is None:
        py_spy = find_py_spy()
        missing = "py-spy not found (not beside sys.executable, not on PATH)"
    else:
        missing = f"py-spy not found at {py_spy!r}"
    usable = py_spy is not None and os.path.isfile(py_spy) and os.access(py_spy, os.X_OK)

    out: dict[int, StackDump] = {}
    failed: dict[int, str] = {}
    if usable:
        for rank, (text, error) in _py_spy_all(py_spy, pids, timeout).items():
            if text is not None:
                out[rank] = StackDump(text, PY_SPY)
            else:
                failed[rank] = error
    else:
        failed = {rank: missing for rank in pids}
    if failed:
        files = stacks_files or {}
        fallback = _faulthandler_all(
            {rank: pids[rank] for rank in failed}, files, failed, timeout, stacks_signal
        )
        out.update(fallback)
    return {rank: out[rank] for rank in pids}


def process_state(pid: int) -> str:
    """The one-letter /proc state of ``pid`` ("" if gone or unreadable): R, S, D, T (stopped), t, Z..."""
    row = _proctree.read(pid)
    return "" if row is None else row.state


def _py_spy_all(exe: str, pids: Mapping[int, int], timeout: float) -> dict[int, tuple[str | None, str]]:
    """Run ``py-spy dump`` on every pid at once; rank -> (text or None, error)."""
    runs: dict[int, tuple[subprocess.Popen, object, object]] = {}
    results: dict[int, tuple[str | None, str]] = {}
    was_stopped: dict[int, bool] = {}
    for rank, pid in pids.items():
        argv = [exe, "dump", "--pid", str(pid)]
        state = process_state(pid)
        was_stopped[rank] = state in ("T", "t")
        if state in _NONBLOCKING_STATES:
            argv.insert(2, "--nonblocking")
        # Files, not pipes: a large dump must not block py-spy while we wait on another.
        outputs = []
        try:
            outputs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=outputs[0], stderr=outputs[1])
        except OSError as exc:
            for f in outputs:
                f.close()
            results[rank] = (None, f"py-spy could not start: {exc}")
            continue
        runs[rank] = (proc, outputs[0], outputs[1])
    deadline = time.monotonic() + timeout
    for rank, (proc, stdout, stderr) in runs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            overran = False
        except subprocess.TimeoutExpired:
            proc.kill()  # the kernel detaches a dead tracer's tracees
            proc.wait()
            overran = True
            _resume_if_left_stopped(pids[rank], was_stopped[rank])
        text, err = _read_all(stdout), _read_all(stderr)
        if overran:
            results[rank] = (None, f"py-spy overran {timeout:g} s and was killed")
        elif proc.returncode != 0:
            results[rank] = (None, f"py-spy exited {proc.returncode}: {_first_error(err or text)}")
        elif not _THREAD.search(text):
            results[rank] = (None, f"py-spy printed no thread: {_first_error(err or text)}")
        else:
            results[rank] = (text, "")
    return results


def _resume_if_left_stopped(pid: int, was_stopped: bool) -> None:
    """SIGCONT ``pid`` if it was running before py-spy and is stopped after killing it.

    py-spy attaches with PTRACE_ATTACH, which queues a SIGSTOP; killed between attach
    and consuming that stop, it can leave the target stopped once the kernel detaches it.
    """
    if not was_stopped and process_state(pid) == "T":
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def _read_all(f) -> str:
    f.seek(0)
    data = f.read().decode("utf-8", "replace")
    f.close()
    return data


def _first_error(text: str) -> str:
    """The useful part of py-spy's error output: the error and its causes, one line."""
    lines = []
    for line in text.splitlines():
        if line.startswith("Stack backtrace:"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)[:300] or "(no output)"


def _registered_pids(text: str) -> set[int]:
    """The pids named on registration lines of a stacks file.

    Any line counts, not only the last: a worker's own subprocess that calls
    ``elaunch.progress()`` inherits the variables and appends its line too.
    """
    pids = set()
    for line in text.splitlines():
        if line.startswith(STACKS_HEADER + " "):
            for field in line.split()[1:]:
                if field.startswith("pid=") and field[4:].isdigit():
                    pids.add(int(field[4:]))
    return pids


def _faulthandler_all(
    pids: Mapping[int, int],
    files: Mapping[int, str],
    why: Mapping[int, str],
    timeout: float,
    signum: int,
) -> dict[int, StackDump]:
    """Signal every registered, running pid; collect what its faulthandler appends."""
    out: dict[int, StackDump] = {}
    waiting: dict[int, tuple[str, int]] = {}  # rank -> (file, size before the signal)
    for rank, pid in pids.items():
        sent = _signal_for_stacks(pid, files.get(rank), signum)
        if isinstance(sent, str):
            out[rank] = StackDump("", UNAVAILABLE, f"{why[rank]}; {sent}")
        else:
            waiting[rank] = (files[rank], sent)
    out.update(_await_dumps(waiting, why, timeout))
    return out


def _signal_for_stacks(pid: int, path: str | None, signum: int) -> int | str:
    """Send ``signum`` to ``pid`` for a faulthandler dump into its stacks file ``path``; return
    the file's size before the signal (bytes), or why the fallback cannot be used."""
    if path is None:
        return "no stacks file for the fallback"
    try:
        with open(path, "rb") as f:
            before = f.read()
    except OSError as exc:
        return f"stacks file unreadable: {exc}"
    if pid not in _registered_pids(before.decode("utf-8", "replace")):
        return f"pid {pid} never called elaunch.progress(), so has no stack signal handler"
    if process_state(pid) in ("T", "t"):
        return f"pid {pid} is stopped and cannot run its signal handler"
    try:
        os.kill(pid, signum)
    except OSError as exc:
        return f"cannot signal pid {pid}: {exc}"
    return len(before)


def _await_dumps(waiting: dict[int, tuple[str, int]], why: Mapping[int, str], timeout: float) -> dict[int, StackDump]:
    """Each rank's dump: what its file ``(path, size before the signal)`` grew by once it stopped growing."""
    out: dict[int, StackDump] = {}
    deadline = time.monotonic() + timeout
    last_size: dict[int, tuple[int, float]] = {}  # rank -> (size, when first seen at that size)
    while waiting:
        now = time.monotonic()
        for rank, (path, start) in list(waiting.items()):
            try:
                size = os.stat(path).st_size
            except OSError:
                size = start
            seen = last_size.get(rank)
            if seen is None or seen[0] != size:
                last_size[rank] = (size, now)
            elif size > start and now - seen[1] >= _SETTLE_S:
                with open(path, "rb") as f:
                    f.seek(start)
                    text = f.read().decode("utf-8", "replace")
                out[rank] = StackDump(text, FAULTHANDLER, why[rank])
                del waiting[rank]
        if not waiting:
            break
        if now >= deadline:
            for rank in waiting:
                out[rank] = StackDump("", UNAVAILABLE,
                                      f"{why[rank]}; no faulthandler dump within {timeout:g} s after the signal")
            break
        time.sleep(min(_POLL_S, max(0.0, deadline - now)))
    return out


_HEADER_LINE = re.compile(r"^(Process \d+:|Python v\d).*$\n?", re.MULTILINE)
#: py-spy's "Thread 1234 (idle)" / "Thread 0x7F.. (active+gil)"; faulthandler's
#: "Thread 0x... (most recent call first)" / "Current thread 0x... (...)".
_THREAD = re.compile(r"^(?:Current thread|Thread) (?:0x[0-9a-fA-F]+|\d+)(?: \([^)]*\))?", re.MULTILINE)
_HEX = re.compile(r"0x[0-9a-fA-F]+")


def normalise_stacks(text: str) -> str:
    """Remove per-process details from a py-spy or faulthandler dump.

    Drops py-spy's ``Process <pid>: <command>`` and ``Python v...`` header lines, turns
    every thread header into ``Thread <tid>`` (py-spy's ``Thread 1234 (idle)`` /
    ``Thread 0x7F.. (active+gil)``, faulthandler's ``Thread 0x...`` and
    ``Current thread 0x...``), replaces other hex numbers (object addresses) by
    ``0x?``, strips trailing spaces and blank lines at both ends. Linear in the text.
    """
    text = _HEADER_LINE.sub("", text)
    text = _THREAD.sub("Thread <tid>", text)
    text = _HEX.sub("0x?", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def group_identical(dumps: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """Group labels whose stack texts are identical after :func:`normalise_stacks`.

    Args:
        dumps: label (e.g. "rank 3") -> stack text.

    Returns:
        ``(normalised text, labels)`` once per distinct text, groups in the order of
        their first label in ``dumps``, labels in ``dumps`` order. Empty texts form a
        group of their own ("").

    Cost: linear in the total text size.
    """
    groups: dict[str, list[str]] = {}
    for label, text in dumps.items():
        groups.setdefault(normalise_stacks(text), []).append(label)
    return list(groups.items())
