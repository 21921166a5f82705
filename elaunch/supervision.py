"""The agent's one supervisor: every helper process and thread, started, checked and stopped in one place.

An agent keeps small helpers beside its workers for the whole run: the store host
(``store_host.py``), the checkpoint persister and replica service
(``checkpoint/persister.py``, ``checkpoint/replicas.py``), the node check's child
(``agent/node_check.py``), the warm pool's templates and spares (``warm.py``), and the
reaper (``reaper.py``). Each is added to the run's one :class:`Supervisor`
(``WorkerLauncher.supervisor``) and declares there, once (:class:`Supervised`):

* **its stop order**: a numeric tier; the supervisor's :meth:`~Supervisor.close` stops the
  lowest tier first, and within a tier the one added last first. :data:`SERVICES` (they
  read the node directory and the round's store) before :data:`SPARES` before
  :data:`STORE` (the workers' store stays up until every other helper is gone); the
  reaper is not a tier: it is the supervisor's own last stop, since it must outlive
  everything it watches (and the agent itself: it is no :class:`Helper`, it has no
  ``PR_SET_PDEATHSIG``).
* **its health and policy**: :meth:`Supervisor.check_all`, at each pass of the agent's
  monitor (``agent.watchdogs.HelperChecks``, polled before the checkpoint keeper), calls
  each watched helper's ``check()``. A helper restarts itself there while its budget lasts
  (``HelperProcess.check``); once it raises, its policy applies: :data:`REPORT` (the
  error, a one-line :class:`~elaunch.procs.helper_process.HelperDied`, goes out of the
  monitor) or :data:`OFF` (one WARNING line, the helper stopped and forgotten, its owner
  told through ``turned_off``: the job goes on without it). A helper checked where it is
  used (the store host, at each round's ``serve``) says ``watched=False``.
* **its descriptors**: ``private_fds()``; :meth:`Supervisor.private_fds` is their union,
  the reaper's included, which a worker forked from the agent closes (``procs.forked``),
  so no forked worker keeps a helper's channel open after the agent let go of it.

The agent's long-lived threads take the same shape, :class:`HelperThread` (a stop event,
``is_alive`` as health, a report when it died of an exception, a join with a timeout at
close), and the first tier, :data:`THREADS`: they read what the helper processes serve, so
they stop before them. Each is declared ``on_death=OFF, wakes=False``: the job goes on
without a thread that died, as it did before it was supervised, but where the interpreter
printed its traceback, it is now one WARNING line at the monitor's next look naming it and
what goes on without it (the traceback at DEBUG); ``wakes=False`` keeps an idle
standalone agent asleep (a thread's death is no reason to wake every interval). Today: the
``--metrics-port`` progress sampler (``agent.progress_sampler``, added by
``AgentMetrics.watch``) and the straggler watch (``agent.straggler_watch``, added at the
monitor's first look of a group).

Not here, each for its lifetime: the ``--metrics-port`` server (``agent.metrics``: bound
before the rendezvous handler or this supervisor exists, so a taken port is bad input, and
closed by the launch after the rendezvous is left); the rendezvous' threads (the dynamic
handler's keep-alive, per round and stopped by the handler before it writes its leave;
etcd-v3's presence lease and watches; the c10d store's start-up thread, one-shot): they
live from the handler's creation, before the run, to its ``shutdown``/``leave``, after the
run's end, and ``rendezvous/`` does not import ``procs/``; tee's copier
(``procs.tee``), one attempt's, stopped by that attempt's ``WorkerProcesses``; and the job
channel's fire-and-forget publishes, one-shot and bounded.

One owner stops each helper: the supervisor, at :meth:`~Supervisor.close`, or earlier at
the request of the helper's feature (:meth:`Supervisor.stop`: the checkpoint keeper stops
its persister after the last persist and before it removes the node directory).
torchrun has no helpers to supervise. Stdlib only (the agent imports this module).
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
#: The store host: the workers' store outlives every other helper.
STORE = 30

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

    Use from the agent's main thread.

    Args:
        reaper: the run's watchdog (``Reaper``), stopped after every helper; or None.
    """

    def __init__(self, reaper: Watchdog | None = None) -> None:
        self.reaper = reaper
        self._entries: list[Supervised] = []

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
        for i, entry in enumerate(self._entries):
            if entry.helper is helper:
                del self._entries[i]
                helper.close()
                return

    def close(self) -> None:
        """Stop every helper in tier order (within a tier, the last added first), then the reaper. Idempotent.

        Every one is stopped even when one raises; the first error is raised after the last stop.
        """
        order = sorted(enumerate(self._entries), key=lambda ie: (ie[1].tier, -ie[0]))
        self._entries = []
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
