"""The agent's event log: one JSON object per line in ``events.jsonl`` of the run's log directory.

Every event has ``time`` (seconds since the epoch), ``kind``, ``node`` (the
rendezvous node id, or ``<host>_<pid>`` where the backend has none), ``host`` and
``round``; the kinds and their fields are documented in docs/events.md, and
``elaunch timeline`` draws them. torch's agent records its events through
``--event-log-handler`` instead (``torch.distributed.elastic.events``); here
that flag only chooses where a copy of each line also goes
(:func:`event_echo`): ``console`` prints it on stderr, as torch's console
handler prints torch's events; ``null`` and ``dynamic_rendezvous`` (a null
handler in torch too) print nothing. The file is written either way.

Writing never raises into the agent: the first OSError is logged once and the
log goes quiet. Observers (:meth:`EventLog.add_observer`, e.g. ``--metrics-port``'s
``elaunch.agent.metrics``) get each event's dict as it is written, file or not.
Each event is one ``os.write`` of one line to a file opened with ``O_APPEND`` (no
buffer, no fsync). The agent's main thread and the straggler watch's thread both
emit: one lock orders each event's write and its observers' calls, so lines never
interleave and observers see the file's order. No signal handler emits (a notice
is written by the agent's loop, :mod:`elaunch.agent.notices`): the lock is never
taken from a handler. Stdlib only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

from elaunch.features.event_log import EVENT_LOG_HANDLERS
from elaunch.spec import signal_name

log = logging.getLogger("elaunch.agent")

#: The file name inside the run's log directory.
EVENTS_FILE = "events.jsonl"
#: Characters of a failure's message kept in an event (its last line).
MESSAGE_CHARS = 300


def event_echo(name: str) -> Callable[[bytes], None] | None:
    """Where ``--event-log-handler=name`` sends a copy of each event line, besides the file.

    Args:
        name: ``"null"`` or ``"dynamic_rendezvous"`` (no copy), ``"console"``
            (stderr), or a name a program registered in torch's handler table
            (``torch.distributed.elastic.events.handlers``; the Python API), whose
            ``logging.Handler`` then receives each line as an INFO record, as
            torch's ``events.record`` sends its events.

    Returns:
        A function writing one encoded line, or None.

    Raises:
        ValueError: ``name`` is none of these (torchrun fails with a KeyError at its
            first event instead).
    """
    if name in ("null", "dynamic_rendezvous"):
        return None
    if name == "console":
        return lambda line: _write_all(2, line)
    try:
        from torch.distributed.elastic.events.handlers import get_logging_handler

        handler = get_logging_handler(name)
    except (ImportError, KeyError):
        raise ValueError(f"event_log_handler={name!r}: not a torch event handler "
                         f"(known: {', '.join(EVENT_LOG_HANDLERS)})") from None

    def to_handler(line: bytes) -> None:
        handler.handle(logging.makeLogRecord({"name": "torchelastic-events", "levelno": logging.INFO,
                                              "levelname": "INFO", "msg": line.decode().rstrip("\n")}))

    return to_handler


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


class EventLog:
    """Appends events to ``path``, one JSON line each; never raises.

    Args:
        path: the file (created on the first event), or None to write no file.
        node: the ``node`` field of every event; host: the ``host`` field.
        echo: also called with each encoded line (see :func:`event_echo`), or None.
        clock: seconds since the epoch (injectable for tests).

    Attributes:
        round: the ``round`` field of events that do not give one (-1 before the first round).
    """

    def __init__(self, path: str | None, node: str, host: str, echo: Callable[[bytes], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.node = node
        self.host = host
        self.round = -1
        self._echo = echo
        self._clock = clock
        self._fd: int | None = None
        self._quiet = path is None  # no file, or it failed once, or closed
        self._closed = False
        self._observers: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()  # emit() runs in the main thread and the straggler watch's

    def add_observer(self, observer: Callable[[dict], None]) -> None:
        """Call ``observer`` with every later event's dict, the one written to the file (with or without a file).

        Called in the thread that emits, in the order of :meth:`emit` calls, before
        :meth:`close`, with this log's lock held (an observer must not emit); the dict
        must not be changed. An observer that raises is logged once and gets no more
        events: it never raises into the agent.
        """
        with self._lock:
            self._observers.append(observer)

    def emit(self, kind: str, round: int | None = None, at: float | None = None, **fields) -> None:
        """Append one event of ``kind`` with ``fields`` (JSON values; others are written as ``str``).

        Thread-safe (one lock per log; blocks while another thread writes an event); not
        for a signal handler (the thread it interrupts may hold the lock).

        Args:
            round: the event's round, default :attr:`round`.
            at: its time in seconds since the epoch, default now.
        """
        with self._lock:
            self._emit(kind, round, at, fields)

    def _emit(self, kind: str, round: int | None, at: float | None, fields: dict) -> None:
        """:meth:`emit` with the lock held."""
        if self._closed or (self._quiet and self._echo is None and not self._observers):
            return
        doc = {"time": round_time(self._clock() if at is None else at), "kind": kind, "node": self.node,
               "host": self.host, "round": self.round if round is None else round, **fields}
        line = (json.dumps(doc, default=str) + "\n").encode()
        try:
            if not self._quiet:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                _write_all(self._fd, line)
            if self._echo is not None:
                self._echo(line)
        except OSError as exc:
            if not self._quiet:
                log.warning("event log %s: %s; no more events are written", self.path, exc)
            self._quiet = True
            self._echo = None
        except Exception as exc:  # a user's torch handler: its fault is logged, never the agent's end
            log.warning("--event-log-handler failed: %s; events go to the file only", exc)
            self._echo = None
        for observer in tuple(self._observers):
            try:
                observer(doc)
            except Exception as exc:
                log.warning("event observer %s failed on a %s event: %r; it gets no more events",
                            getattr(observer, "__qualname__", observer), kind, exc)
                self._observers.remove(observer)

    def close(self) -> None:
        """Close the file; later events are dropped (observers get none either). Idempotent.

        Waits for an event another thread is writing (the fd is not closed under it).
        """
        with self._lock:
            self._quiet = True
            self._closed = True
            self._echo = None
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def round_time(t: float) -> float:
    """``t`` to the microsecond (the file stays short; no event is finer than that)."""
    return round(t, 6)


def came_and_left(before: Mapping[str, int] | frozenset, after: Mapping[str, int] | frozenset) -> tuple[list, list]:
    """Who came and who left between two rounds' members (sets of ids, or counts of addresses)."""
    b, a = Counter(before), Counter(after)
    return sorted((a - b).elements()), sorted((b - a).elements())


def failure_fields(f) -> dict:
    """The ``failure`` object of an event from a ``FailureRecord`` or a ``ProcessFailure``."""
    rank = getattr(f, "rank", getattr(f, "global_rank", -1))
    host = getattr(f, "host", None) or getattr(f, "hostname", "")
    text = getattr(f, "message", None)
    if text is None:  # a ProcessFailure: what its summary would show first
        data = f.error_data or {}
        msg = data.get("message")
        text = (msg.get("message") if isinstance(msg, dict) else msg) or f.detail or f.stderr_tail or ""
    # the summary's "To enable traceback see: ..." (no error file) says nothing about the failure
    lines = [ln for ln in str(text).splitlines() if ln.strip() and not ln.startswith("To enable traceback see:")]
    return {"rank": rank, "host": host, "exitcode": f.exitcode, "signal": signal_of(f.exitcode),
            "message": lines[-1].strip()[:MESSAGE_CHARS] if lines else ""}


def signal_of(exitcode: int | None) -> str | None:
    """``"SIGKILL"`` for -9, None for a normal exit."""
    if exitcode is None or exitcode >= 0:
        return None
    return signal_name(exitcode)


class AgentEvents(EventLog):
    """The events of one agent run, one method per kind (docs/events.md), called where the agent logs them.

    Same arguments as :class:`EventLog`; ``budget`` is ``--max-restarts``.
    """

    def __init__(self, path: str | None, node: str, host: str, budget: int,
                 echo: Callable[[bytes], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(path, node, host, echo, clock)
        self.budget = budget
        self._members: Mapping[str, int] | frozenset | None = None  # the last round's, to say who came and left
        self._joined_at = 0.0
        self._ended = False
        self._pending = None  # a failure of another node whose restart is logged once the next round formed
        self._restart_count: int | None = None  # the job's count at the last round (RendezvousInfo.restart_count)
        self._stopped_step: int | None = None  # the step the last group stopped at (``restart``'s ``step``)
        self._started_at = 0.0  # when the last workers_started was written (seconds since the epoch)

    def rendezvous_joining(self) -> None:
        """``rendezvous_join``: this node starts joining the next round (``round``: its last one, -1 at first)."""
        self._joined_at = time.monotonic()
        self.emit("rendezvous_join")

    def rendezvous_complete(self, info, members: frozenset | None) -> None:
        """``rendezvous_complete`` of ``info`` (a RendezvousInfo), then ``membership_change`` if it changed.

        Args:
            members: the round's node ids where the job channel knows them (``round_members``),
                else empty or None (the nodes' addresses are compared instead).
        """
        self.round = info.round
        members = members if members else Counter(n.addr for n in info.nodes)
        self.emit("rendezvous_complete", rank=info.rank, world_size=info.world_size,
                  seconds=round(time.monotonic() - self._joined_at, 3), nodes=[n.addr for n in info.nodes],
                  restart_count=info.restart_count)
        if self._members is not None:
            came, left = came_and_left(self._members, members)
            if came or left:
                self.emit("membership_change", came=came, left=left, world_size=info.world_size)
        self._members = members
        before, self._restart_count = self._restart_count, info.restart_count
        if self._pending is not None and info.restart_count is not None:
            failure, self._pending = self._pending, None
            if before is not None and info.restart_count <= before:
                # the reporting node did not count it: its workers failed because a member node was lost
                # (it published their failure before its failure probe had told it so)
                self.restart(False, info.restart_count, "node_lost", failure, failed_round=failure.round)
            else:
                self.restart(True, info.restart_count, "failure", failure, failed_round=failure.round)

    def restart_after_rendezvous(self, failure) -> None:
        """Log the job's restart for ``failure`` (a FailureRecord of another node) after the next round formed.

        The reporting node counts it once every member answered: the job's count is
        certain only in the next round's ``restart_count``. When that count did not rise, the
        reporting node did not count the failure (its workers failed because a member node was
        lost): the restart is logged not counted, cause ``node_lost``, as that node logs it.
        """
        self._pending = failure

    def workers_started(self, attempt: int, workers, pids: Mapping[int, int], master: str) -> None:
        """``workers_started``: the attempt's ranks and pids (``workers``: its ``Worker`` list)."""
        self._started_at = self._clock()
        self.emit("workers_started", at=self._started_at, attempt=attempt, ranks=[w.global_rank for w in workers],
                  local_ranks=[w.local_rank for w in workers], pids=[pids[w.local_rank] for w in workers],
                  master=master)

    def workers_exited(self, workers, before: Mapping[int, int | None], codes: Mapping[int, int | None],
                       times: Mapping[int, float], step: int | None = None) -> None:
        """One ``worker_exited`` per worker, at its exit time; ``stopped`` when the agent stopped it.

        Args:
            before: local rank -> exit code when the agent began stopping the group (None: running).
            codes, times: the final exit codes and exit times (seconds since the epoch).
            step: the highest step the group reported (``elaunch.progress(step=)``), None: none;
                also the next ``restart``'s ``step``.
        """
        self._stopped_step = step
        for w in workers:
            lr = w.local_rank
            code = codes.get(lr)
            self.emit("worker_exited", at=times.get(lr), rank=w.global_rank, local_rank=lr, pid=w.pid,
                      exitcode=code, signal=signal_of(code), stopped=before.get(lr) is None, step=step)

    def training(self, step: int | None, at: float) -> None:
        """``training``: every local rank of the attempt called ``elaunch.progress()``, the last at ``at``.

        Args:
            step: the highest step reported so far in the attempt, or None.
            at: the last rank's first call, seconds since the epoch (the event's ``time``; not
                before ``workers_started``'s, which a fast worker may beat).
        """
        self.emit("training", at=max(at, self._started_at), step=step)

    def caught_up(self, step: int) -> None:
        """``caught_up``: after a stop, the node's highest reported step reached the one it had reached before."""
        self.emit("caught_up", step=step)

    def restart(self, counted: bool, count: int, cause: str, failure=None, failed_round: int | None = None) -> None:
        """``restart``: the group re-forms (``cause``: ``failure``, ``membership`` or ``node_lost``)."""
        failed_round = self.round if failed_round is None else failed_round
        self.emit("restart", round=failed_round, counted=counted, count=count, budget=self.budget, cause=cause,
                  failed_round=failed_round,
                  failure=None if failure is None else failure_fields(failure), step=self._stopped_step)

    def hang(self, hung: Mapping[int, object], culprit: int | None, stuck: bool = False,
             quiet_seconds: float | None = None) -> None:
        """``hang``: workers made no progress (``hung``: global rank -> its failure) or sit in D state.

        Args:
            quiet_seconds: how long the hung ranks had been quiet (or in D state) at the verdict,
                seconds (the goodput ledger moves them from productive to hung); None: unknown.
        """
        self.emit("hang", ranks=sorted(hung), culprit=culprit, stuck=stuck,
                  quiet_seconds=None if quiet_seconds is None else round(quiet_seconds, 3))

    def notice(self, sig: int, at: float | None = None) -> None:
        """``notice``: a forwarded signal (``--forward-signals``); the job keeps running.

        Args:
            at: when the signal arrived (seconds since the epoch; the agent's loop writes the
                event a moment later), default now.
        """
        self.emit("notice", at=at, signal=signal_of(-sig))

    def checkpoint_restore(self, round: int, step: int, sources: Mapping[int, str]) -> None:
        """``checkpoint_restore``: this node's workers of ``round`` restore ``step``.

        Args:
            sources: global rank -> where its snapshot comes from: ``memory`` (this node's),
                ``peer`` (fetched from another node's memory), ``disk`` (``--checkpoint-dir``),
                or ``missing`` (no source could be read: its ``ckpt.load()`` fails).
        """
        self.emit("checkpoint_restore", round=round, step=step,
                  sources={str(r): kind for r, kind in sorted(sources.items())})

    def checkpoint_persisted(self, step: int, path: str, seconds: float) -> None:
        """``checkpoint_persisted``: this node's files of ``step`` are in ``path`` (``seconds`` to read and write)."""
        self.emit("checkpoint_persisted", step=step, path=path, seconds=round(seconds, 3))

    def job_end(self, result=None, error: BaseException | None = None, sig: int | None = None) -> None:
        """``job_succeeded`` or ``job_failed`` (from a RunResult, an exception, or a handled signal); once."""
        if self._ended:
            return
        self._ended = True
        if result is not None and not result.is_failed():
            self.emit("job_succeeded", restarts=result.restarts)
        elif result is not None:
            root = result.failures.get(result.root_rank) if result.root_rank is not None else None
            root = root or (min(result.failures.values(), key=lambda f: f.timestamp) if result.failures else None)
            self.emit("job_failed", restarts=result.restarts, failure=None if root is None else failure_fields(root))
        elif sig is not None:
            self.emit("job_failed", signal=signal_of(-sig))
        elif type(error).__name__ == "RendezvousGracefulExitError":  # more nodes than MAX: this one exits 0
            self.emit("node_not_needed", reason=str(error)[:MESSAGE_CHARS])
        else:
            self.emit("job_failed", error=f"{type(error).__name__}: {error}"[:MESSAGE_CHARS])
