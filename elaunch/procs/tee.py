"""Copy tee'd worker log files to the agent's console, each line prefixed.

Mirrors torch's ``TailLog`` (tee = redirect to the file + follow the file), with
one thread for all files instead of one per file, and partial lines held back
until their newline (or the end) so prefixes never land mid-line. A file followed
without a prefix (a worker's stderr that elaunch captures for the failure summary,
shown as if inherited) is copied as its bytes are read instead, partial lines
included, so a progress bar redrawn with ``\r`` (tqdm) moves on the console as it
would on an inherited stream.

torch's ``TailLog`` looks at each file every 0.1 s. Here the thread sleeps until
the kernel says a followed file's directory changed (inotify, through the
``inotify_simple`` library), so following costs nothing while no bytes arrive;
where inotify is unavailable (not Linux, the library missing, the per-user limit
of inotify instances or watches reached) it looks every ``interval`` seconds.

The inotify watch is made only once the copy has run :data:`INOTIFY_AFTER` seconds
(until then the thread looks every ``interval`` seconds): closing an inotify
instance waits for the kernel's RCU grace period, 8-20 ms measured on a 2-core
VM, which a job that ends within its first seconds (a short script, a worker that
fails at once) would otherwise wait for at its end, and the library's import is
saved too.

The copy is a helper of the agent's supervisor (``elaunch.supervision``, tier ``THREADS``,
policy off): its attempt's ``WorkerProcesses`` adds it when the workers started and stops it
there (``Supervisor.stop``) once they are gone, after the final copy. A copy that failed is
one WARNING line naming the error, at the monitor's next look or at its stop, whichever
comes first (the traceback at DEBUG); the job goes on without it.
"""

from __future__ import annotations

import codecs
import logging
import math
import os
import select
import threading
from typing import TextIO

from elaunch.supervision import HelperDied

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05  # seconds between looks at the followed files, where inotify is unavailable
#: Seconds the copy looks every ``interval`` before it makes its inotify watch (a short job never makes one).
INOTIFY_AFTER = 2.0
_inotify_simple = None  # the module once imported; False: not available


def inotify_lib():
    """Return the ``inotify_simple`` module, or None where it cannot be imported.

    Imported on the first follow, after the first workers were started, not with
    the agent (a few ms). The library finds libc on first use with
    ``ctypes.util.find_library``, which execs ``ldconfig -p``: it is handed this
    process's own libc instead (the handle ``spawn.py`` uses for prctl).
    """
    global _inotify_simple
    if _inotify_simple is None:
        try:
            import inotify_simple
        except ImportError:  # not installed, or not Linux: poll instead
            _inotify_simple = False
        else:
            if getattr(inotify_simple, "_libc", False) is None:
                import ctypes

                try:
                    inotify_simple._libc = ctypes.CDLL(None, use_errno=True)
                except OSError:
                    pass
            _inotify_simple = inotify_simple
    return _inotify_simple or None


class _Follow:
    """One followed file. With a prefix: whole lines, each prefixed (a last unterminated one
    at the end, given a newline). Without: the bytes as read, decoded incrementally (a UTF-8
    character split across reads is held back until complete), nothing added."""

    def __init__(self, path: str, dst: TextIO, prefix: str) -> None:
        self.path, self.dst, self.prefix = path, dst, prefix
        self.fh = None
        self.partial = b""
        self._decoder = None if prefix else codecs.getincrementaldecoder("utf-8")("replace")

    def pump(self, final: bool) -> None:
        if self.fh is None:
            try:
                self.fh = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            except FileNotFoundError:
                return
        data = self.fh.read()
        if self._decoder is not None:
            text = self._decoder.decode(data, final=final)
        else:
            text = self._lines(data, final)
        if text:
            try:
                self.dst.write(text)
                self.dst.flush()
            except (OSError, ValueError):  # console closed: keep the files, drop the copy
                pass

    def _lines(self, data: bytes, final: bool) -> str:
        """The complete lines of what was held back plus ``data``, prefixed ("" if none)."""
        if not data and not (final and self.partial):
            return ""
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return "".join(f"{self.prefix}{line.decode('utf-8', 'replace')}\n" for line in lines)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def _watcher(paths: list[str]):
    """An inotify instance watching the directories of ``paths``, or None when inotify cannot be used.

    A directory watch also sees a file created after it was added, and writes to
    any file in it (``IN_MODIFY``).
    """
    inotify_simple = inotify_lib()
    if inotify_simple is None:
        return None
    try:
        watcher = inotify_simple.INotify(nonblocking=True)
    except OSError as exc:  # e.g. fs.inotify.max_user_instances reached
        log.debug("inotify unavailable (%s); polling the tee'd files every %g s", exc, POLL_INTERVAL)
        return None
    f = inotify_simple.flags
    mask = f.MODIFY | f.CREATE | f.MOVED_TO | f.CLOSE_WRITE
    try:
        for d in sorted({os.path.dirname(os.path.abspath(p)) for p in paths}):
            watcher.add_watch(d, mask)
    except OSError as exc:  # no such directory, or fs.inotify.max_user_watches reached
        log.debug("cannot watch the tee'd files' directories (%s); polling instead", exc)
        watcher.close()
        return None
    return watcher


class Tee:
    """Follow files and copy their new lines, prefixed, to console streams.

    Args:
        follows: ``(path, destination stream, prefix)`` triples; files need not exist yet
            (their directories should: a missing one makes the copy poll). An empty
            prefix copies the bytes as they are read, partial lines included (nothing
            added at the end); a non-empty one copies whole lines only, each prefixed.
        interval: seconds between looks at the files while polling (before the inotify
            watch is made, and where inotify is unavailable).
        use_inotify: False: always poll every ``interval`` seconds.
        inotify_after: seconds the thread polls before it makes the inotify watch (see
            :data:`INOTIFY_AFTER`); 0: at :meth:`start`.

    Attributes:
        mode: how the running thread learns of new bytes: ``"inotify"`` or ``"poll"``
            (``"poll"`` until the watch is made; None before :meth:`start`, or when there
            is nothing to follow).
    """

    def __init__(self, follows: list[tuple[str, TextIO, str]], interval: float = POLL_INTERVAL,
                 use_inotify: bool = True, inotify_after: float = INOTIFY_AFTER) -> None:
        self._follows = [_Follow(p, d, pre) for p, d, pre in follows]
        self._interval = interval
        self._use_inotify = use_inotify
        self._inotify_after = inotify_after
        self._done = threading.Event()
        self._lock = threading.Lock()  # stop() and the thread's move to inotify: one or the other first
        self._stop_r, self._stop_w = -1, -1
        self._watcher = None
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None  # what ended the copy, until reported (check, or stop)
        self.mode: str | None = None

    name = "tee"  #: how the supervisor's warning names it

    def start(self) -> "Tee":
        """Start the follower thread (no-op when there is nothing to follow)."""
        if self._follows and self._thread is None:
            self.mode = "poll"
            if self._use_inotify and self._inotify_after <= 0 and not self._watch():
                self._use_inotify = False  # unavailable: the thread polls
            self._thread = threading.Thread(target=self._run, name="elaunch-tee", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> bool:
        """Make the inotify watch (and the pipe that ends its wait); True when made. Sets :attr:`mode`."""
        watcher = _watcher([f.path for f in self._follows])
        if watcher is None:
            return False
        self._stop_r, self._stop_w = os.pipe()
        self._watcher = watcher
        self.mode = "inotify"
        return True

    def _pump_all(self) -> None:
        for f in self._follows:
            f.pump(final=False)

    def _run(self) -> None:
        try:
            if self._watcher is None:
                # poll; past inotify_after seconds, move to inotify unless stop() came first
                polls = math.inf if not self._use_inotify else max(0, math.ceil(self._inotify_after / self._interval))
                while polls > 0:
                    if self._done.wait(self._interval):
                        return
                    self._pump_all()
                    polls -= 1
                with self._lock:
                    if self._done.is_set() or not self._watch():
                        polls = math.inf
                while polls > 0:  # inotify unavailable: poll on
                    if self._done.wait(self._interval):
                        return
                    self._pump_all()
            self._pump_all()  # bytes written before the watches were added
            while True:
                ready, _, _ = select.select([self._watcher, self._stop_r], [], [])
                if self._stop_r in ready:
                    return
                self._watcher.read(timeout=0)  # drain: one look covers every event so far
                self._pump_all()
        except Exception as exc:  # never take the agent down for a console copy: reported by check() or stop()
            log.debug("tee of worker logs failed", exc_info=True)
            self._error = exc

    def check(self) -> bool:
        """Raise ``HelperDied`` once if the copy failed; never restarts it (False).

        Raises:
            HelperDied: the copying thread died of an exception (one line: its type and text).
        """
        error, self._error = self._error, None
        if error is not None:
            raise HelperDied(f"{self.name} thread died: {type(error).__name__}: {error}")
        return False

    def private_fds(self) -> tuple[int, ...]:
        """None: it runs after its attempt's workers started, and is stopped before another attempt's."""
        return ()

    def stop(self) -> None:
        """Copy whatever is left (including a last unterminated line) and stop. Idempotent.

        A failure not yet reported (:meth:`check`) is logged here: one WARNING line."""
        with self._lock:
            self._done.set()
            if self._stop_w >= 0:
                os.write(self._stop_w, b"!")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for f in self._follows:
            try:
                f.pump(final=True)
            except OSError:
                pass
            f.close()
        self._follows = []
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1
        try:
            self.check()
        except HelperDied as exc:
            log.warning("%s; worker output was not copied to the console since", exc)

    close = stop


def follows_for(
    files: dict[int, str], dst: TextIO, prefixes: dict[int, str], unprefixed: frozenset[int] | set[int] = frozenset()
) -> list[tuple[str, TextIO, str]]:
    """Build Tee triples for ``files`` (local rank -> path).

    The prefix is ``prefixes[local_rank]`` (default ``[<local_rank>]:``), or "" for the
    local ranks in ``unprefixed`` (their bytes are then copied as read, see :class:`Tee`).
    """
    return [
        (path, dst, "" if lr in unprefixed else prefixes.get(lr, f"[{lr}]:"))
        for lr, path in sorted(files.items())
        if path != os.devnull
    ]
