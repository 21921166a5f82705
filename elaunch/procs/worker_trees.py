"""Every process of one group's worker trees, found again whenever the agent asks.

A worker's tree is its process group, its session, their live descendants, and
the worker's descendants that left both (``setsid``) and lost their parent. With
a reaper the agent is a child subreaper, so such orphans are re-parented to it:
they are found among its children by the worker's env entries they carry
(:func:`~elaunch.procs.spawn.marker_entries`), adopted, and handed to the reaper.
Without one, :meth:`WorkerTrees.snapshot` remembers every process of the trees
every ``SNAPSHOT_INTERVAL`` seconds so that they are still found after they left.

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from . import _proctree

if TYPE_CHECKING:
    from .reaper import Reaper

#: Seconds between snapshots of the worker trees (to remember children that left), when
#: the agent is no child subreaper.
SNAPSHOT_INTERVAL = 1.0


def _environ(pid: int) -> set[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return set(f.read().split(b"\0"))
    except OSError:
        return set()


class WorkerTrees:
    """The processes of one group's worker trees.

    Args:
        pids: local rank -> worker pid (also its process group and session id).
        markers: per worker, the env entries its descendants inherit.
        reaper: the watchdog that is told of adopted orphans, or None.
        subreaper: the agent is a child subreaper (orphans come to it: no snapshots needed).

    Attributes:
        next_snapshot: ``time.monotonic()`` of the next :meth:`snapshot` due (inf: none).
    """

    def __init__(self, pids: Mapping[int, int], markers: list[frozenset[bytes]], reaper: "Reaper | None",
                 subreaper: bool) -> None:
        self._pids = dict(pids)
        self._markers = markers
        self._reaper = reaper
        self._known: set[tuple[int, int]] = set()
        self._adopted: set[int] = set()
        self._released: set[int] = set()  # workers let go of alive (drop): never orphans of these trees
        self.next_snapshot = float("inf") if subreaper else time.monotonic() + 0.2

    def snapshot(self, running: Collection[int]) -> None:
        """Remember every process of the trees of the ``running`` worker pids."""
        self._known = {p.key for p in self.family(running).values()}  # includes live known ones
        if self.next_snapshot != float("inf"):
            self.next_snapshot = time.monotonic() + SNAPSHOT_INTERVAL

    def family(self, running: Collection[int]) -> dict[int, _proctree.Proc]:
        """Every live process of the trees (pid -> Proc); ``running``: the workers not yet reaped."""
        table = _proctree.scan()
        roots = [*running, *self._orphans(table)]
        return _proctree.tree(table, roots=roots, groups=self._pids.values(), known=self._known)

    def _orphans(self, table: dict[int, _proctree.Proc]) -> list[int]:
        """Descendants of our workers the agent adopted (see :func:`~elaunch.procs.spawn.become_subreaper`).

        Children of the agent it did not start, carrying a worker's env entries
        (run id, error file, ranks, master port). Each is also given to the reaper,
        which kills it if the agent is killed.
        """
        me, ours = os.getpid(), set(self._pids.values()) | self._released
        if self._reaper is not None:
            ours.add(self._reaper.pid)
        found = []
        for p in table.values():
            if p.ppid != me or p.pid in ours:
                continue
            if p.pid not in self._adopted:
                env = _environ(p.pid)  # read once, held against every worker's markers
                if not any(m and m <= env for m in self._markers):
                    continue
            found.append(p.pid)
        new = set(found) - self._adopted
        if new and self._reaper is not None:
            self._reaper.watch(new)
        self._adopted |= new
        return found

    def drop(self, pids: "Collection[int]") -> None:
        """Forget the workers ``pids``, released alive to a later attempt (``WorkerProcesses.release``).

        They are no longer among the trees, nor ever taken for an orphan of them (they are
        children of the agent carrying a worker's env entries, as an orphan would be).
        """
        self._pids = {lr: pid for lr, pid in self._pids.items() if pid not in pids}
        self._released |= set(pids)
        self._known = {k for k in self._known if k[0] not in self._released}

    def release(self) -> None:
        """Reap the adopted orphans that died (they are the agent's children now); tell the reaper to forget all."""
        for pid in list(self._adopted):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._adopted.discard(pid)
        if self._reaper is not None:
            self._reaper.forget([*self._pids.values(), *self._adopted])
