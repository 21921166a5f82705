"""The launch's one supervisor: every helper process and thread of the agent, started, checked and stopped in one place.

An agent keeps small helpers beside its workers: the store host (``procs/store_host.py``),
the checkpoint persister and replica service (``checkpoint/persister.py``,
``checkpoint/replicas.py``), the node check's child (``agent/node_check.py``), the warm
pool's templates and spares (``procs/warm.py``), the reaper (``procs/reaper.py``), the
``--metrics-port`` server and the rendezvous' keep-alive. ``elaunch.launch.run_job`` makes
one :class:`Supervisor` for the whole launch, before anything else starts, and hands it to
the metrics server, the rendezvous handler (``registry.create_handler(supervisor=)``) and the
agent, whose launcher keeps it (``WorkerLauncher.supervisor``). Each helper declares there,
once (:class:`Supervised`):

* **its stop order**: a numeric tier; :meth:`~Supervisor.close` stops the lowest tier first,
  and within a tier the one added last first. A run's helpers: :data:`THREADS` (they read what
  the helpers below serve) before :data:`SERVICES` (they read the node directory and the
  round's store) before :data:`SPARES` before :data:`STORE` (the workers' store stays up
  until every other helper of the run is gone); the run's end (``close(below=LAUNCH)``, the
  launcher's close) stops these and then the reaper, which is not a tier: it must outlive
  everything it watches (and the agent itself: it is no :class:`Helper`, it has no
  ``PR_SET_PDEATHSIG``). The launch's helpers, from :data:`LAUNCH` on, live from before the
  run to after it: :data:`RENDEZVOUS` (the keep-alive, which its handler stops before it
  writes its leave; here only what is left at the launch's end) before :data:`METRICS`
  (``/metrics`` answers until the very end); the launch's close (``close()``, after the
  rendezvous was shut down or left) stops them.
* **its health and policy**: :meth:`Supervisor.check_all`, at each pass of the agent's
  monitor (``agent.watchdogs.HelperChecks``, polled before the checkpoint keeper), calls
  each watched helper's ``check()``. A helper restarts itself there while its budget lasts
  (``HelperProcess.check``); once it raises, its policy applies: :data:`REPORT` (the
  error, a one-line :class:`HelperDied`, goes out of the monitor) or :data:`OFF` (one
  WARNING line, the helper stopped and forgotten, its owner told through ``turned_off``:
  the job goes on without it). A helper checked where it is used (the store host, at each
  round's ``serve``) says ``watched=False``. Only a running agent looks: before the first
  round and after the run nothing is checked.
* **its descriptors**: ``private_fds()``; :meth:`Supervisor.private_fds` is their union,
  the reaper's included, which a worker forked from the agent closes (``procs.forked``),
  so no forked worker keeps a helper's channel (or the metrics port) open after the agent
  let go of it.

The agent's long-lived threads take the same shape, :class:`HelperThread` (a stop event,
``is_alive`` as health, a report when it died of an exception, a join with a timeout at
close). Each is declared ``on_death=OFF, wakes=False``: the job goes on without a thread
that died, as it did before it was supervised, but where the interpreter printed its
traceback, it is now one WARNING line at the monitor's next look naming it and what goes
on without it (the traceback at DEBUG); ``wakes=False`` keeps an idle standalone agent
asleep (a thread's death is no reason to wake every interval). Today: the ``--metrics-port``
progress sampler (``agent.progress_sampler``, added by ``AgentMetrics.watch``) and the
straggler watch (``agent.straggler_watch``, added at the monitor's first look of a group),
and the console copy of one attempt's tee'd output (``procs.tee``, added by that attempt's
``WorkerProcesses`` once its workers started and stopped there after the final copy; a copy
that failed and was not yet seen is the same one line at its stop; before, an ERROR line
with its traceback), and the checkpoint keeper's slot reservation for a round's restoring
ranks (``checkpoint.keeper``: it ends by itself; the keeper stops it at the next round and at
its close, before the node directory goes), tier :data:`THREADS`; the dynamic rendezvous' keep-alive
(``rendezvous.dynamic.keepalive``, c10d and etcd: added when a round starts, stopped with
``Supervisor.stop`` when the handler leaves it), tier :data:`RENDEZVOUS`, and beside it the
dynamic rendezvous' presence port (``rendezvous.dynamic.presence``: a listening socket, no
thread; added before the first round, ``private_fds()`` is the socket, stopped when the node
leaves the rendezvous for good); and the ``--metrics-port`` server
(``agent.metrics.AgentMetrics``, prometheus_client's own thread: ``check()`` reports it
gone, ``private_fds()`` is its listening socket), tier :data:`METRICS`, added by the launch
right after it was bound (a taken port is bad input before anything else starts).

Not here, each for a reason: etcd-v3's presence lease and its watches' opener
(``rendezvous/etcd``): started and stopped with the etcd client by the backend's round
stores (``on_close``), whose lifetime is the client's, not a tier's; the c10d store's
start-up thread (``rendezvous/c10d_agent_store.py``: one-shot, its result and error waited
for at the handler's first use of the store) and the job channel's fire-and-forget
publishes (``rendezvous/job_channel.py``: one-shot daemon threads, each write bounded by the
backend's ``read_timeout``, never waited for).

One owner stops each helper: the supervisor, at :meth:`~Supervisor.close`, or earlier at
the request of the helper's feature (:meth:`Supervisor.stop`: the checkpoint keeper stops
its persister after the last persist and before it removes the node directory; the
rendezvous handler its keep-alive before it writes its leave). A supervisor made by a
launcher, or a handler, without one given is its own (tests, programs that build their
own). torchrun has no helpers to supervise. Stdlib only, and it imports nothing of
elaunch: ``procs/``, ``rendezvous/`` and ``agent/`` all import it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

#: Stop tiers (lowest first): the agent's long-lived threads (they read what the helpers below serve) ...
THREADS = 5
#: ... the checkpoint services and the node check's child ...
SERVICES = 10
#: The warm pool's templates and spares.
SPARES = 20
#: The store host: the workers' store outlives every other helper of the run.
STORE = 30
#: The launch's helpers, from here on: they live from before the run to after it, and only the
#: launch's :meth:`Supervisor.close` stops them; the run's end (``close(below=LAUNCH)``) stops the rest.
LAUNCH = 40
#: The rendezvous handler's threads (the dynamic handler's keep-alive), stopped by the handler
#: itself before it writes its leave, or here, after the rendezvous was shut down ...
RENDEZVOUS = LAUNCH
#: ... and the ``--metrics-port`` server: it answers scrapes until the very end of the launch.
METRICS = 50

#: Policies when a helper's ``check()`` raises: the error goes out of :meth:`Supervisor.check_all` ...
REPORT = "report"
#: ... or the helper is stopped with one warning and the job goes on without it.
OFF = "off"


class HelperDied(ChildProcessError):
    """A helper died while the agent needed it, and its policy says report (an ``OSError``).

    Its text is one line: the helper's name and how it ended (a process's pid and exit status or
    signal; a thread's exception). Defined here, below both ``procs/`` and ``rendezvous/``, whose
    helpers raise it; ``procs.helper_process`` re-exports it.
    """


class Helper(Protocol):
    """What every helper offers the supervisor.

    Attributes:
        name: how log lines and errors name it.
    """

    name: str

    def check(self) -> bool:
        """Look at its health: True if it was restarted; raise ``OSError`` (``HelperDied``) when it died for good."""

    def private_fds(self) -> tuple[int, ...]:
        """Descriptors a worker forked from the agent must close."""

    def close(self) -> None:
        """Stop it and release what it holds. Idempotent."""


class Watchdog(Protocol):
    """What the supervisor needs of the run's reaper (``procs.reaper.Reaper``), its last stop."""

    def private_fds(self) -> tuple[int, ...]:
        """Descriptors a worker forked from the agent must close."""

    def close(self) -> None:
        """Stop it."""


@dataclass
class Supervised:
    """One helper as declared to the supervisor (see the module docstring).

    Attributes:
        helper: the helper.
        tier: its stop tier (:data:`SERVICES`, :data:`SPARES`, :data:`STORE`).
        on_death: :data:`REPORT` or :data:`OFF`, applied when its ``check()`` raises ``OSError``.
        watched: False when its feature checks it where it uses it, not :meth:`Supervisor.check_all`.
        note: for :data:`OFF`, what the warning adds after the error (what goes on without it).
        turned_off: called once :data:`OFF` stopped it (its owner lets go of it), or None.
        wakes: False when its death may wait for the monitor's next look (a thread's): it does
            not make the monitor wake every interval (:attr:`Supervisor.polls`).
    """

    helper: Helper
    tier: int
    on_death: str = REPORT
    watched: bool = True
    note: str = ""
    turned_off: Callable[[], None] | None = None
    wakes: bool = True


class Supervisor:
    """Owns one agent run's helpers and, last, its reaper (see the module docstring).

    Checked (:meth:`check_all`) and closed from the agent's main thread; :meth:`add` and
    :meth:`stop` may come from another (the rendezvous' keep-alive starts and stops where its
    round is joined or left).

    Args:
        reaper: the run's watchdog (``Reaper``), stopped after every helper; or None.
    """

    def __init__(self, reaper: Watchdog | None = None) -> None:
        self.reaper = reaper
        self._entries: list[Supervised] = []
        self._lock = threading.Lock()  # the list only: a rendezvous thread may start or stop its keep-alive

    def add(self, helper: Helper, tier: int, *, on_death: str = REPORT, watched: bool = True, note: str = "",
            turned_off: Callable[[], None] | None = None, wakes: bool = True, start: bool = False) -> Helper:
        """Take ``helper`` (started already, or started here with ``start=True``); return it.

        Raises:
            ValueError: ``on_death`` is not a policy, or the helper was added already.
            OSError: ``start=True`` and it cannot be started (it is not added).
        """
        if on_death not in (REPORT, OFF):
            raise ValueError(f"on_death={on_death!r}: not {REPORT!r} or {OFF!r}")
        if self.has(helper):
            raise ValueError(f"{helper.name} is supervised already")
        if start:
            helper.start()
        with self._lock:
            self._entries.append(Supervised(helper, tier, on_death, watched, note, turned_off, wakes))
        return helper

    def has(self, helper: Helper) -> bool:
        """True while ``helper`` is supervised (added, not stopped or turned off)."""
        return any(e.helper is helper for e in self._entries)

    @property
    def polls(self) -> bool:
        """True while a watched helper that ``wakes`` runs: the monitor must call :meth:`check_all` every interval."""
        return any(e.watched and e.wakes for e in self._entries)

    def check_all(self) -> None:
        """Check every watched helper and apply its policy (one pass of the agent's monitor).

        Raises:
            OSError: a :data:`REPORT` helper died for good (``HelperDied``: one line naming it).
        """
        for entry in list(self._entries):
            if not entry.watched:
                continue
            try:
                entry.helper.check()
            except OSError as exc:
                if entry.on_death == REPORT:
                    raise
                log.warning("%s; %s", exc, entry.note or f"{entry.helper.name} is off")
                self.stop(entry.helper)
                if entry.turned_off is not None:
                    entry.turned_off()

    def private_fds(self) -> tuple[int, ...]:
        """Every descriptor a worker forked from the agent must close: each helper's, then the reaper's."""
        fds = [fd for e in self._entries for fd in e.helper.private_fds()]
        if self.reaper is not None:
            fds.extend(self.reaper.private_fds())
        return tuple(fds)

    def stop(self, helper: Helper) -> None:
        """Stop ``helper`` now and forget it (its feature is done with it before the run's end). Idempotent."""
        with self._lock:
            found = [e for e in self._entries if e.helper is helper]
            self._entries = [e for e in self._entries if e.helper is not helper]
        if found:
            helper.close()

    def close(self, below: int | None = None) -> None:
        """Stop every helper in tier order (within a tier, the last added first), then the reaper. Idempotent.

        Every one is stopped even when one raises; the first error is raised after the last stop.

        Args:
            below: stop only the helpers of a lower tier (the run's end: ``below=LAUNCH``, the
                launcher's close), and the reaper; the others stay for the launch's close. None: all.
        """
        with self._lock:
            mine = [e for e in self._entries if below is None or e.tier < below]
            self._entries = [e for e in self._entries if not (below is None or e.tier < below)]
        order = sorted(enumerate(mine), key=lambda ie: (ie[1].tier, -ie[0]))
        first: BaseException | None = None
        for _, entry in order:
            try:
                entry.helper.close()
            except BaseException as exc:  # noqa: BLE001 - the others are stopped all the same
                log.warning("%s could not be stopped cleanly: %s", entry.helper.name, exc)
                first = first or exc
        reaper, self.reaper = self.reaper, None
        if reaper is not None:
            try:
                reaper.close()
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first


class HelperThread:
    """A long-lived thread of the agent in a helper's shape (:class:`Helper`).

    ``target(stop)`` runs in a daemon thread until it returns; ``stop`` is a
    ``threading.Event`` set at :meth:`close`, which the target watches (``stop.wait(s)``
    as its sleep). Its health is ``is_alive``: :meth:`check` raises
    :class:`~elaunch.procs.helper_process.HelperDied` once when the target died of an
    exception (one line: the thread's name, the exception's type and text; the traceback
    is logged at DEBUG when it dies); a target that returned is simply done.

    Args:
        name: how errors name it (``"progress sampler"``).
        target: the thread's body, given the stop event.
        join_timeout: seconds :meth:`close` waits for the thread after setting the event.
        thread_name: the ``threading.Thread``'s name (as ``py-spy`` shows it); ``name`` when None.
        warn_late: log a WARNING when the thread outlives ``join_timeout`` at :meth:`close` (False: a
            thread known to end on its own soon after, a daemon the agent's exit does not wait for).
    """

    def __init__(self, name: str, target: Callable[[threading.Event], None], join_timeout: float = 5.0,
                 thread_name: str | None = None, warn_late: bool = True) -> None:
        self.name = name
        self._target = target
        self._join_timeout = join_timeout
        self._thread_name = thread_name or name
        self._warn_late = warn_late
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._told = False

    def start(self) -> None:
        """Start the thread (once; a second call does nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._target(self.stopping)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            log.debug("the %s thread died", self.name, exc_info=True)
            self._error = exc

    @property
    def thread(self) -> threading.Thread | None:
        """The ``threading.Thread`` once :meth:`start` made it."""
        return self._thread

    def is_alive(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> bool:
        """Raise ``HelperDied`` once if the thread died of an exception; never restarts it (False).

        Raises:
            HelperDied: the target raised (reported once).
        """
        if self._error is not None and not self._told and not self.is_alive():
            self._told = True
            raise HelperDied(f"{self.name} thread died: {type(self._error).__name__}: {self._error}")
        return False

    def private_fds(self) -> tuple[int, ...]:
        """None: a thread's descriptors are its owner's."""
        return ()

    def close(self) -> None:
        """Set the stop event and wait up to ``join_timeout`` seconds for the thread. Idempotent."""
        self.stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._join_timeout)
            if thread.is_alive() and self._warn_late:
                log.warning("the %s thread did not stop within %g s", self.name, self._join_timeout)
