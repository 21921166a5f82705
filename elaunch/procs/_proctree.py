"""Process-table snapshots from /proc, for finding whole worker trees.

Stdlib only and free of package-relative imports: the reaper watchdog runs
``python -S`` on a script beside this file and imports it as ``_proctree``,
so it must load without site-packages. One pass over ``/proc/<pid>/stat``
gives parent, process group, session and start time of every process, which
``psutil`` would need one call per process for (it has no pgid/sid).
"""

from __future__ import annotations

import os
import signal
from typing import Iterable, NamedTuple


class Proc(NamedTuple):
    """One row of /proc: ``start`` is the start time in clock ticks since boot."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int
    state: str

    @property
    def key(self) -> tuple[int, int]:
        """``(pid, start)``: identifies a process across pid reuse."""
        return (self.pid, self.start)


def read(pid: int) -> Proc | None:
    """Return the /proc row of ``pid``, or None if it does not exist (or is unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2 :].split()
        return Proc(pid, int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]), rest[0].decode())
    except (ValueError, IndexError):
        return None


def scan() -> dict[int, Proc]:
    """Return every process currently in /proc, keyed by pid."""
    out: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = read(int(name))
            if p is not None:
                out[p.pid] = p
    return out


def tree(
    table: dict[int, Proc],
    roots: Iterable[int] = (),
    groups: Iterable[int] = (),
    known: Iterable[tuple[int, int]] = (),
) -> dict[int, Proc]:
    """Select a process family from ``table``.

    Members: the ``roots`` pids, every process whose process group or session id is
    in ``groups``, every still-existing ``known`` ``(pid, start)`` key, and all
    descendants (by parent pid) of those. Zombies are included (they may still have
    live children); the calling process is never included.

    Returns:
        The members, keyed by pid.
    """
    groups = set(groups)
    known = set(known)
    roots = set(roots)
    me = os.getpid()
    members = {
        p.pid: p
        for p in table.values()
        if p.pid in roots or p.pgid in groups or p.sid in groups or p.key in known
    }
    children: dict[int, list[Proc]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p)
    todo = list(members)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child.pid not in members:
                members[child.pid] = child
                todo.append(child.pid)
    members.pop(me, None)
    return members


def exists(pid: int) -> bool:
    """True while ``pid`` exists (a zombie too; one this process may not signal too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live(procs: Iterable[Proc]) -> list[Proc]:
    """Return the members of ``procs`` that still exist with the same identity and are not zombies."""
    out = []
    for p in procs:
        now = read(p.pid)
        if now is not None and now.start == p.start and now.state not in ("Z", "X"):
            out.append(p)
    return out


def kill(procs: Iterable[Proc], sig: int) -> None:
    """Send ``sig`` to each live member of ``procs`` (identity re-checked; gone ones ignored)."""
    for p in live(procs):
        try:
            os.kill(p.pid, sig)
        except OSError:
            pass


def killpg(pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group in ``pgids``; missing groups are ignored."""
    for pgid in pgids:
        if pgid > 1:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass


KILL = signal.SIGKILL
