"""torch's file-based timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) as a watchdog, without importing torch.

A worker that runs ``configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))``
and then ``with expires(after=60): ...`` writes one JSON line per acquire/release into
a FIFO (torch's ``torch/distributed/elastic/timer/file_based_local_timer.py``)::

    {"version": 1, "pid": 1234, "scope_id": "train.py#42",
     "expiration_time": 1700000000.5, "signal": 9}

``expiration_time`` is wall-clock (``time.time()``) seconds; a negative one releases
the scope. :class:`FileTimerWatchdog` owns that FIFO and is a
:class:`~elaunch.agent.watchdog.Watchdog`: each poll drains the FIFO and returns an
:class:`~elaunch.agent.watchdog.Alarm` naming each pid whose timer expired before its
release, with the timer's signal (the client's default is SIGKILL); the monitor sends
it to exactly that pid, as torch's ``FileTimerServer`` does (a worker, or any other
process that registered a scope, such as a worker's child). The alarm does not fail
the group by itself: a worker that dies of the signal is a worker failure like any
other, judged by its exit. The agent runs it when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``
(see :func:`file_timer_env`), as torch's ``LocalElasticAgent`` does.

Timing: torch's server checks every 0.1 s in its own thread. This watchdog asks the
monitor to look at least every ``interval_s`` (0.1 s) while it is on, whatever
``--monitor-interval``: an expired worker is signalled within about 0.1 s, and the
monitor's other checks (the rendezvous included) run at that pace too.

Deliberate differences from torch's server:

* After signalling an expired worker torch's server sends the same signal to its own
  process (the agent). This one does not: the agent handles the dead worker as any
  other failure (restart or report).
* A pid that may not be signalled (EPERM) is logged once and its timers dropped;
  torch's server retries it at every check.
* The FIFO's read end is opened when the watchdog is made, so a worker's first
  non-blocking open cannot find no reader; closing never waits on a FIFO no
  client ever opened.
* An existing regular file at the path is an error, not silently deleted (a stale
  FIFO is replaced).

Stdlib only; no torch.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from elaunch.spec import signal_name
from elaunch.agent.watchdog import Alarm, Watched
from elaunch.procs import _proctree

__all__ = [
    "ENABLE_ENV",
    "FILE_ENV",
    "Expired",
    "FileTimerWatchdog",
    "TimerRequest",
    "apply_requests",
    "due",
    "file_timer_env",
]

log = logging.getLogger("elaunch.agent")

#: ``1`` turns the file timer watchdog on (torch's ``TORCHELASTIC_ENABLE_FILE_TIMER``).
ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
#: The FIFO path, given to the workers (torch's ``TORCHELASTIC_TIMER_FILE``).
FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: Largest request line read; torch's client refuses lines longer than PIPE_BUF.
_MAX_LINE = 64 * 1024

Key = tuple[int, str]


def file_timer_env(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to run the file timer watchdog, and its FIFO path, as torch's agent decides.

    Mirrors ``LocalElasticAgent._setup_local_watchdog``: the watchdog runs when
    ``TORCHELASTIC_ENABLE_FILE_TIMER`` is exactly ``"1"``; its path is
    ``TORCHELASTIC_TIMER_FILE``, or, when that is unset, a fresh
    ``<tempdir>/watchdog_timer_<uuid4>``. Workers must get ``TORCHELASTIC_TIMER_FILE=path``
    whenever ``path`` is not "" (torch propagates a set path even when disabled).

    Difference: an empty ``TORCHELASTIC_TIMER_FILE`` counts as unset (torch would try
    to create a FIFO named "").

    Args:
        environ: the agent's environment (e.g. ``os.environ``); not modified.

    Returns:
        ``(enabled, path)``; ``path`` is "" when disabled and no path is set.
    """
    enabled = str(environ.get(ENABLE_ENV, "")) == "1"
    path = environ.get(FILE_ENV) or ""
    if enabled and not path:
        path = os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")
    return enabled, path


@dataclass(frozen=True)
class TimerRequest:
    """One line of the FIFO protocol (torch's ``FileTimerRequest``).

    Attributes:
        pid: the worker process that acquired or released the timer.
        scope_id: the scope name (torch's default is ``"<file>#<line>"`` of the caller).
        expiration_time: wall-clock seconds since the epoch; negative means release.
        signal: what to send the pid on expiry; 0 or negative means do not signal.
    """

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def key(self) -> Key:
        return (self.pid, self.scope_id)

    @classmethod
    def parse(cls, line: str | bytes) -> TimerRequest:
        """Parse one JSON line as torch's ``FileTimerClient`` writes it.

        Raises:
            ValueError: not JSON, a field is missing or of the wrong type, or the pid is
                not a process id (> 0 and < 2**31: 0 or a negative one would name a
                process group).
        """
        try:
            obj = json.loads(line)
            request = cls(int(obj["pid"]), str(obj["scope_id"]), float(obj["expiration_time"]), int(obj["signal"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad timer request {line!r}: {exc}") from exc
        if not 0 < request.pid < 2**31:
            raise ValueError(f"bad timer request {line!r}: pid {request.pid} is not a process id")
        return request


@dataclass(frozen=True)
class Expired:
    """A worker to signal: the earliest of its expired timers that carries a signal.

    Attributes:
        request: that timer; when none of them carries a signal, the earliest one
            (its ``signal`` is then <= 0 and the worker is not signalled, as in torch).
        overdue_s: seconds between its expiration time and now.
        scopes: every expired scope of that pid, earliest first.
    """

    request: TimerRequest
    overdue_s: float
    scopes: tuple[str, ...]


def apply_requests(timers: Mapping[Key, TimerRequest], requests: Iterable[TimerRequest]) -> dict[Key, TimerRequest]:
    """Return ``timers`` after ``requests`` in order: acquire sets (pid, scope), release drops it."""
    out = dict(timers)
    for request in requests:
        if request.expiration_time < 0:
            out.pop(request.key, None)
        else:
            out[request.key] = request
    return out


def due(timers: Mapping[Key, TimerRequest], now: float) -> dict[int, Expired]:
    """Which workers to act on at wall-clock ``now``, as torch's ``_run_watchdog`` decides.

    A timer is expired when ``expiration_time <= now``. Per pid, the expired timers are
    sorted by expiration time and the first with ``signal > 0`` is the one to act on.

    Returns:
        pid -> :class:`Expired`, for every pid with at least one expired timer.
    """
    by_pid: dict[int, list[TimerRequest]] = {}
    for request in timers.values():
        if request.expiration_time <= now:
            by_pid.setdefault(request.pid, []).append(request)
    out = {}
    for pid, expired in by_pid.items():
        expired.sort(key=lambda r: r.expiration_time)
        chosen = next((r for r in expired if r.signal > 0), expired[0])
        out[pid] = Expired(chosen, now - chosen.expiration_time, tuple(r.scope_id for r in expired))
    return out


class FileTimerWatchdog:
    """Serve torch's ``FileTimerClient`` FIFO: name the pids whose timers expired, with their signal.

    Creates the FIFO and opens its read end at once (workers may write as soon as
    they start); :meth:`close` removes it.

    Args:
        path: the FIFO to create (the ``path`` of :func:`file_timer_env`).
        interval_s: the most seconds between two polls: a worker is signalled at most
            about this long after its timer expires. torch's agent uses 0.1.
        clock: wall-clock seconds (the protocol's expiration times are ``time.time()``).

    Attributes:
        polls: True: the FIFO is read while the group runs, not only on a child's exit.
        interval: ``interval_s``.

    Raises:
        ValueError: ``interval_s`` is not positive.
        FileExistsError: something other than a FIFO exists at ``path``.
        OSError: the FIFO cannot be created or opened.

    Cost: one non-blocking read of the FIFO per poll.
    """

    def __init__(self, path: str, interval_s: float = 0.1, *, clock: Callable[[], float] = time.time) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s ({interval_s}) must be > 0")
        self.path = path
        self.polls = True
        self.interval = float(interval_s)
        self._clock = clock
        self._timers: dict[Key, TimerRequest] = {}
        self._pending = b""  # a request line not yet complete
        self._fds = self._open_fifo(path)  # read end, our own write end
        log.info("file timer on %s (TORCHELASTIC_ENABLE_FILE_TIMER=1; checked every %g s)", path, self.interval)

    @staticmethod
    def _open_fifo(path: str) -> tuple[int, int]:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISFIFO(mode):
                raise FileExistsError(f"{FILE_ENV}={path!r} exists and is not a FIFO")
            os.unlink(path)  # a stale FIFO from an earlier run, as torch replaces it
        os.mkfifo(path, 0o600)
        try:
            rd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # Our own writer keeps the FIFO from reading as EOF between clients.
            return rd, os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            os.unlink(path)
            raise

    def env(self, local_rank: int) -> dict[str, str]:
        """``TORCHELASTIC_TIMER_FILE``: the FIFO's path, as torch's agent gives every worker."""
        return {FILE_ENV: self.path}

    def new_attempt(self, round: int) -> None:
        """Nothing to forget: the timers of the last attempt's workers go as their pids die."""

    def timers(self) -> dict[Key, TimerRequest]:
        """The timers held: (pid, scope_id) -> request."""
        return dict(self._timers)

    def poll(self, watched: Watched | None) -> Alarm | None:
        """Read the FIFO; return the alarm naming the pids to signal now (None: none), as torch's ``_run_watchdog``.

        Per pid with expired timers, the earliest that carries a signal is acted on
        (:func:`due`); when none does, the pid is not signalled (logged). Either way its
        timers are dropped, and so are those of pids no longer alive. ``watched`` is
        not read: a scope may be any process's.
        """
        if self._fds is None:
            return None
        now = self._clock()
        timers = apply_requests(self._timers, self._read())
        signals = {}
        for pid, expired in due(timers, now).items():
            request = expired.request
            if request.signal <= 0:
                log.warning("file timer: scope %r of pid %d expired %.2f s ago; its timer carries no signal, "
                            "not killing it", request.scope_id, pid, expired.overdue_s)
            else:
                log.warning("file timer: scope %r of pid %d expired %.2f s ago; sending %s",
                            request.scope_id, pid, expired.overdue_s, signal_name(-request.signal))
                signals[pid] = request.signal
            timers = {k: r for k, r in timers.items() if k[0] != pid}
        self._timers = {k: r for k, r in timers.items() if _proctree.exists(k[0])}
        return Alarm("file_timer", {}, signals=signals, fails=False) if signals else None

    def close(self) -> None:
        """Close and remove the FIFO; timers still held are dropped unsignalled. Idempotent."""
        fds, self._fds = self._fds, None
        if fds is None:
            return
        for fd in fds:
            os.close(fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _read(self) -> list[TimerRequest]:
        """Every complete request line in the FIFO now (bad lines logged and skipped)."""
        data = self._pending
        while True:
            try:
                chunk = os.read(self._fds[0], 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        *lines, self._pending = data.split(b"\n")
        if len(self._pending) > _MAX_LINE:
            log.warning("file timer: dropping %d bytes without a newline", len(self._pending))
            self._pending = b""
        requests = []
        for line in lines:
            if line.strip():
                try:
                    requests.append(TimerRequest.parse(line))
                except ValueError as exc:
                    log.warning("file timer: %s", exc)
        return requests


