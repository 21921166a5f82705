"""torch's file-based hang guard, served by elaunch without importing torch.

A worker that runs ``configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))``
and then ``with expires(after=60): ...`` writes one JSON line per acquire/release into
a FIFO (torch's ``torch/distributed/elastic/timer/file_based_local_timer.py``)::

    {"version": 1, "pid": 1234, "scope_id": "train.py#42",
     "expiration_time": 1700000000.5, "signal": 9}

``expiration_time`` is wall-clock (``time.time()``) seconds; a negative one releases
the scope. :class:`FileTimerServer` reads that FIFO in a daemon thread and, when a
timer expires before its release, sends the timer's signal (the client's default is
SIGKILL) to that pid, as torch's ``FileTimerServer`` does. The agent runs it when
``TORCHELASTIC_ENABLE_FILE_TIMER=1`` (see :func:`file_timer_env`), as torch's
``LocalElasticAgent`` does.

Deliberate differences from torch's server:

* After signalling an expired worker torch's server sends the same signal to its own
  process (the agent). This one does not: it calls ``on_expired`` and the agent
  handles the dead worker as any other failure (restart or report).
* The FIFO's read end is opened before :meth:`FileTimerServer.start` returns, so a
  worker's first non-blocking open cannot find no reader; and :meth:`stop` never
  hangs on a FIFO no client ever opened.
* An existing regular file at the path is an error, not silently deleted (a stale
  FIFO is replaced).

Stdlib only; no torch.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "ENABLE_ENV",
    "FILE_ENV",
    "Expired",
    "FileTimerServer",
    "TimerRequest",
    "apply_requests",
    "due",
    "file_timer_env",
]

log = logging.getLogger(__name__)

#: ``1`` turns the file timer server on (torch's ``TORCHELASTIC_ENABLE_FILE_TIMER``).
ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
#: The FIFO path, given to the workers (torch's ``TORCHELASTIC_TIMER_FILE``).
FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: Largest request line read; torch's client refuses lines longer than PIPE_BUF.
_MAX_LINE = 64 * 1024

Key = tuple[int, str]


def file_timer_env(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to run the file timer server, and its FIFO path, as torch's agent decides.

    Mirrors ``LocalElasticAgent._setup_local_watchdog``: the server runs when
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
            ValueError: not JSON, or a field is missing or of the wrong type.
        """
        try:
            obj = json.loads(line)
            return cls(int(obj["pid"]), str(obj["scope_id"]), float(obj["expiration_time"]), int(obj["signal"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad timer request {line!r}: {exc}") from exc


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileTimerServer:
    """Serve torch's ``FileTimerClient`` FIFO: kill workers whose timers expire.

    Args:
        path: the FIFO to create (the ``path`` of :func:`file_timer_env`).
        interval_s: seconds between checks while any timer is held; a worker is
            signalled at most about this long after its timer expires. torch's agent
            uses 0.1. With no timer held the thread sleeps until a request arrives.
        on_expired: called from the server thread, once per worker signalled (or
            whose expired timers carry no signal), after signalling it. Exceptions
            are logged, not raised.
        clock: wall-clock seconds (the protocol's expiration times are ``time.time()``).
        kill: ``os.kill``-like ``(pid, signal)``; injected by tests.

    Raises:
        ValueError: ``interval_s`` is not positive.

    Cost: one daemon thread; while timers are held one wake-up per ``interval_s``,
    otherwise none.
    """

    def __init__(
        self,
        path: str,
        interval_s: float = 0.1,
        *,
        on_expired: Callable[[Expired], None] | None = None,
        clock: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s ({interval_s}) must be > 0")
        self.path = path
        self.interval_s = float(interval_s)
        self._on_expired = on_expired
        self._clock = clock
        self._kill = kill
        self._timers: dict[Key, TimerRequest] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._fds: tuple[int, int, int, int] | None = None  # fifo read, fifo write, wake read, wake write
        self._created = False

    def start(self) -> None:
        """Create the FIFO, open its read end, start the thread. Returns at once.

        Raises:
            FileExistsError: something other than a FIFO exists at ``path``.
            OSError: the FIFO cannot be created or opened.
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("FileTimerServer already started")
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISFIFO(mode):
                raise FileExistsError(f"{FILE_ENV}={self.path!r} exists and is not a FIFO")
            os.unlink(self.path)  # a stale FIFO from an earlier run, as torch replaces it
        os.mkfifo(self.path, 0o600)
        self._created = True
        try:
            rd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # Our own writer keeps the FIFO from reading as EOF (POLLHUP) between clients.
            wr = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._remove_fifo()
            raise
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fds = (rd, wr, wake_r, wake_w)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="elaunch-file-timer", daemon=True)
        self._thread.start()
        log.info("file timer server on %s (check every %g s)", self.path, self.interval_s)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (waiting up to ``timeout`` seconds), close and remove the FIFO.

        Timers still held are dropped unsignalled. Idempotent; never raises.
        """
        thread, fds = self._thread, self._fds
        self._stopping.set()
        if fds is not None:
            try:
                os.write(fds[3], b"x")
            except OSError:
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
        if fds is not None:
            self._fds = None
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._remove_fifo()

    def timers(self) -> dict[Key, TimerRequest]:
        """A snapshot of the timers held: (pid, scope_id) -> request."""
        with self._lock:
            return dict(self._timers)

    def __enter__(self) -> FileTimerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _remove_fifo(self) -> None:
        if self._created:
            self._created = False
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _loop(self) -> None:
        assert self._fds is not None
        rd, _wr, wake_r, _wake_w = self._fds
        poller = select.poll()
        poller.register(rd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        pending = b""
        while not self._stopping.is_set():
            with self._lock:
                idle = not self._timers
            try:
                poller.poll(None if idle else self.interval_s * 1000)
            except InterruptedError:
                continue
            if self._stopping.is_set():
                return
            chunk, pending = self._drain(rd, pending)
            try:
                self._tick(chunk)
            except Exception:  # keep guarding the other workers
                log.exception("file timer server: error handling timers")

    def _drain(self, fd: int, pending: bytes) -> tuple[list[TimerRequest], bytes]:
        """Read every complete line available; return the requests and the partial rest."""
        data = pending
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        *lines, rest = data.split(b"\n")
        if len(rest) > _MAX_LINE:
            log.warning("file timer server: dropping %d bytes without a newline", len(rest))
            rest = b""
        requests = []
        for line in lines:
            if line.strip():
                try:
                    requests.append(TimerRequest.parse(line))
                except ValueError as exc:
                    log.warning("file timer server: %s", exc)
        return requests, rest

    def _tick(self, requests: list[TimerRequest]) -> None:
        """Apply requests, signal expired workers, forget timers of dead ones."""
        now = self._clock()
        with self._lock:
            timers = apply_requests(self._timers, requests)
        acted = set()
        for pid, expired in due(timers, now).items():
            if self._act(pid, expired):
                acted.add(pid)
        timers = {k: r for k, r in timers.items() if k[0] not in acted and _alive(k[0])}
        with self._lock:
            self._timers = timers

    def _act(self, pid: int, expired: Expired) -> bool:
        """Signal ``pid`` for ``expired``; False to retry at the next tick."""
        request = expired.request
        if request.signal <= 0:
            log.warning(
                "file timer: scope %r of pid %d expired %.2f s ago; its timer carries no signal, not killing it",
                request.scope_id, pid, expired.overdue_s,
            )
        else:
            try:
                self._kill(pid, request.signal)
            except ProcessLookupError:
                pass  # already gone
            except OSError as exc:
                log.error("file timer: cannot send signal %d to pid %d: %s; retrying", request.signal, pid, exc)
                return False
            log.warning(
                "file timer: scope %r of pid %d expired %.2f s ago; sent %s",
                request.scope_id, pid, expired.overdue_s, _signal_name(request.signal),
            )
        if self._on_expired is not None:
            try:
                self._on_expired(expired)
            except Exception:
                log.exception("file timer: on_expired callback failed")
        return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
