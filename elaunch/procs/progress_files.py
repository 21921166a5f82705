"""Agent side of progress reporting: per-rank progress files and their watch.

:class:`ProgressFiles` creates, for each local rank, a small zero-filled file that the
worker maps and bumps through :func:`elaunch.progress` (see :mod:`elaunch._worker_progress`),
plus a stacks file the worker's faulthandler appends to on :data:`STACKS_SIGNAL`. The
agent maps the same files read-only, so reading every counter costs no system call.

:class:`ProgressWatch` turns successive counter readings into, per local rank, whether
it ever reported, how long since its counter last changed, and the last step it gave. Deciding which ranks
are hung from that is left to the caller (a pure function elsewhere).

Stdlib only; no torch.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._worker_progress import (
    EXIT_MARK,
    FIRST_CALL_US,
    MAPPED_BYTES,
    PROGRESS_FILE_ENV,
    STACKS_FILE_ENV,
    STACKS_SIGNAL_ENV,
    STAMP_ASK,
    STAMP_NS,
    STAMP_STEP,
    STEP,
)
from .snapshot_dir import PROGRESS_PREFIX

__all__ = [
    "FILE_BYTES",
    "PROGRESS_FILE_ENV",
    "STACKS_FILE_ENV",
    "STACKS_SIGNAL",
    "STACKS_SIGNAL_ENV",
    "ProgressFiles",
    "ProgressWatch",
    "RankProgress",
]

#: The signal a worker's faulthandler dumps its stacks on. A real-time signal that
#: neither torch, NCCL/gloo nor Python use; its default action terminates, so it is
#: sent only to a process that registered a handler (see :mod:`elaunch.procs.stacks`).
STACKS_SIGNAL: int = signal.SIGRTMIN + 3
#: Size of each progress file in bytes: the uint64 counter at offset 0, the exit mark
#: (the worker's pid once its interpreter exits) at offset 8, the last step + 1 at
#: offset 16, the first call's time (microseconds since the epoch) at offset 24, the
#: stamp request, step and time (nanoseconds since the epoch) at offsets 32, 40 and 48,
#: the rest zero (room for later fields without changing the file's size).
FILE_BYTES = 64
#: Where private directories go when /dev/shm is usable (a tmpfs: no disk writes).
_SHM = "/dev/shm"


def _private_dir(base_dir: str | None) -> str:
    """Create a fresh 0700 directory ``elaunch-progress-<random>-<pid>`` under ``base_dir``, /dev/shm, or the temp dir.

    The pid at the end lets the next agent's :func:`~elaunch.procs.snapshot_dir.sweep` remove
    one left by an agent that died with its reaper.
    """
    if base_dir is None:
        base_dir = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK) else None
    suffix = f"-{os.getpid()}"
    try:
        return tempfile.mkdtemp(suffix, PROGRESS_PREFIX, base_dir)
    except OSError:
        if base_dir != _SHM:
            raise
        return tempfile.mkdtemp(suffix, PROGRESS_PREFIX)  # /dev/shm full or refused


class ProgressFiles:
    """One progress file and one stacks file per local rank, in a private directory.

    Args:
        local_ranks: the local ranks to create files for (e.g. ``range(nproc)``).
        base_dir: where to create the private directory; default a fresh directory
            under /dev/shm when it exists and is writable, else
            :func:`tempfile.gettempdir`.
        stacks_signal: the signal number workers register for stack dumps.

    Raises:
        OSError: the directory or a file cannot be created.

    Cost: creating writes one 64-byte file and one empty file per rank and maps each
    progress file once; :meth:`read` makes no system call. The mapping is writable for
    one word only: the stamp request (:meth:`ask_stamps`). Use as a context manager or
    call :meth:`close`; the directory is removed on close.
    """

    def __init__(
        self,
        local_ranks: Iterable[int],
        base_dir: str | None = None,
        stacks_signal: int = STACKS_SIGNAL,
    ) -> None:
        self._ranks = sorted(set(local_ranks))
        self._signal = int(stacks_signal)
        self._dir: str | None = _private_dir(base_dir)
        self._maps: dict[int, mmap.mmap] = {}
        self._views: dict[int, memoryview] = {}
        try:
            for rank in self._ranks:
                with open(self.progress_file(rank), "wb") as f:
                    f.write(bytes(FILE_BYTES))
                open(self.stacks_file(rank), "wb").close()
                with open(self.progress_file(rank), "r+b") as f:  # writable: the stamp request
                    m = mmap.mmap(f.fileno(), MAPPED_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps[rank] = m
                self._views[rank] = memoryview(m).cast("Q")
        except BaseException:
            self.close()
            raise

    @property
    def directory(self) -> str:
        """The private directory holding the files.

        Raises:
            ValueError: after :meth:`close`.
        """
        if self._dir is None:
            raise ValueError("ProgressFiles is closed")
        return self._dir

    @property
    def local_ranks(self) -> list[int]:
        """The local ranks, ascending."""
        return list(self._ranks)

    def progress_file(self, local_rank: int) -> str:
        """Path of ``local_rank``'s progress file (a name; no check that the rank exists)."""
        return os.path.join(self.directory, f"progress_{local_rank}")

    def stacks_file(self, local_rank: int) -> str:
        """Path of ``local_rank``'s stacks file (a name; no check that the rank exists)."""
        return os.path.join(self.directory, f"stacks_{local_rank}")

    def stacks_files(self) -> dict[int, str]:
        """Local rank -> stacks file path, the ``stacks_files`` argument of ``dump_stacks``."""
        return {rank: self.stacks_file(rank) for rank in self._ranks}

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables to add to ``local_rank``'s worker environment.

        Returns:
            ``ELAUNCH_PROGRESS_FILE``, ``ELAUNCH_STACKS_FILE`` and
            ``ELAUNCH_STACKS_SIGNAL`` (a decimal signal number).

        Raises:
            KeyError: ``local_rank`` was not given to the constructor.
            ValueError: after :meth:`close`.
        """
        self.directory  # noqa: B018 - raises ValueError once closed
        if local_rank not in self._views:
            raise KeyError(f"no progress file for local rank {local_rank} (have {self._ranks})")
        return {
            PROGRESS_FILE_ENV: self.progress_file(local_rank),
            STACKS_FILE_ENV: self.stacks_file(local_rank),
            STACKS_SIGNAL_ENV: str(self._signal),
        }

    def read(self) -> dict[int, int]:
        """Local rank -> current counter (0 until the worker's first ``progress()`` call).

        No system call: the files are mapped. Returns ``{}`` after :meth:`close`.
        """
        return {rank: view[0] for rank, view in self._views.items()}

    def exit_marks(self) -> dict[int, int]:
        """Local rank -> pid of its worker that started to exit (ranks without a mark are left out).

        A worker's ``elaunch.progress()`` writes its pid at offset 8 from an
        :mod:`atexit` handler. No system call. Returns ``{}`` after :meth:`close`.
        """
        return {rank: view[EXIT_MARK] for rank, view in self._views.items() if view[EXIT_MARK]}

    def steps(self) -> dict[int, int | None]:
        """Local rank -> the last step its worker gave ``elaunch.progress(step=)``, None before any.

        No system call. Returns ``{}`` after :meth:`close`.
        """
        return {rank: view[STEP] - 1 if view[STEP] else None for rank, view in self._views.items()}

    def first_calls(self) -> dict[int, float]:
        """Local rank -> when its worker first called ``elaunch.progress()`` (seconds since the epoch).

        Ranks that have not called yet are left out. No system call; ``{}`` after :meth:`close`.
        """
        return {rank: view[FIRST_CALL_US] / 1e6 for rank, view in self._views.items() if view[FIRST_CALL_US]}

    def ask_stamps(self) -> None:
        """Ask every rank's worker to stamp its next ``progress()`` call (step and time).

        One store per rank, no system call; a request not yet answered stays. See
        :meth:`stamps` and the module docstring of :mod:`elaunch._worker_progress`.
        Does nothing after :meth:`close`.
        """
        for view in self._views.values():
            view[STAMP_ASK] = 1

    def stamps(self) -> dict[int, tuple[int, int]]:
        """Local rank -> ``(step, ns)`` of the call that answered its last :meth:`ask_stamps`.

        The step is the last one given to ``progress(step=)`` by then, or the call counter
        when no call gave one; ``ns`` the call's time, nanoseconds since the epoch. Ranks
        whose request is still pending (no call since it), or that never stamped, are left
        out. No system call; ``{}`` after :meth:`close`.
        """
        return {rank: (view[STAMP_STEP], view[STAMP_NS]) for rank, view in self._views.items()
                if view[STAMP_NS] and not view[STAMP_ASK]}

    def reset(self) -> None:
        """Zero every counter, exit mark, step, first-call time and stamp, empty every stacks file, for a new set of workers.

        Call only when no worker of the previous set is alive (they would keep
        counting into the same files), and before starting the next set: the stacks
        files' registration lines must name only live workers (see ``dump_stacks``).

        Raises:
            ValueError: after :meth:`close`.
        """
        for rank in self._ranks:
            with open(self.progress_file(rank), "r+b") as f:
                f.write(bytes(MAPPED_BYTES))
            open(self.stacks_file(rank), "wb").close()

    def close(self) -> None:
        """Unmap the files and remove the directory. Idempotent; never raises."""
        for view in self._views.values():
            view.release()
        for m in self._maps.values():
            m.close()
        self._views.clear()
        self._maps.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ProgressFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProgressFiles(dir={self._dir!r}, local_ranks={self._ranks})"


@dataclass(frozen=True)
class RankProgress:
    """What a hang decision needs about one local rank.

    Attributes:
        ever_reported: the counter was seen above 0 since the rank was first seen (or
            since :meth:`ProgressWatch.reset`): the worker called ``progress()``.
        seconds_since_last_change: seconds from the last change of the counter (or
            from when the rank was first seen, if it never changed) to the ``now`` of
            the latest update.
        counter: the latest counter value.
        step: the last step the rank reported (``progress(step=)``), None before any.
    """

    ever_reported: bool
    seconds_since_last_change: float
    counter: int
    step: int | None = None


class ProgressWatch:
    """Per local rank: the last counter value, when it last changed, whether it ever reported.

    Feed it ``(counters, now)`` on every monitor tick, ``now`` from
    :func:`time.monotonic`. A rank's clock starts when it first appears in
    ``counters``; any change of its counter (up, or down after a reset) restarts it.
    Ranks missing from an update are dropped. Pure bookkeeping: no clock, no I/O.
    """

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._changed_at: dict[int, float] = {}
        self._reported: set[int] = set()
        self._steps: dict[int, int] = {}
        self._now: float | None = None

    def update(self, counters: Mapping[int, int], now: float,
               steps: Mapping[int, int | None] | None = None) -> dict[int, RankProgress]:
        """Record one reading and return the table as of ``now``.

        Args:
            counters: local rank -> counter, e.g. :meth:`ProgressFiles.read`.
            now: a monotonic time in seconds, not earlier than the previous update's.
            steps: local rank -> last reported step or None (:meth:`ProgressFiles.steps`);
                None: no step read this time (the last ones known stay).

        Returns:
            Local rank -> :class:`RankProgress`, for exactly the ranks in ``counters``.

        Raises:
            ValueError: ``now`` is earlier than the previous update's ``now``.
        """
        if self._now is not None and now < self._now:
            raise ValueError(f"now ({now}) is earlier than the previous update ({self._now})")
        self._now = now
        for rank in list(self._last):
            if rank not in counters:
                del self._last[rank], self._changed_at[rank]
                self._reported.discard(rank)
                self._steps.pop(rank, None)
        for rank, value in counters.items():
            if self._last.get(rank) != value:
                self._last[rank] = value
                self._changed_at[rank] = now
            if value > 0:
                self._reported.add(rank)
        for rank, step in (steps or {}).items():
            if step is not None and rank in self._last:
                self._steps[rank] = step
        return self.table()

    def table(self) -> dict[int, RankProgress]:
        """The table as of the latest update's ``now`` (``{}`` before any update)."""
        now = self._now
        if now is None:
            return {}
        return {
            rank: RankProgress(rank in self._reported, now - self._changed_at[rank], value, self._steps.get(rank))
            for rank, value in sorted(self._last.items())
        }

    def reset(self) -> None:
        """Forget everything (a new set of workers): the next update starts every clock."""
        self._last.clear()
        self._changed_at.clear()
        self._reported.clear()
        self._steps.clear()
        self._now = None
