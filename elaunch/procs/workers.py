"""Start, watch and stop the worker processes of one group (one attempt).

Mirrors torch's ``SubprocessContext`` + ``SubprocessHandler``: each worker is a
``Popen`` in its own session (so its process group id is its pid), its streams
sent where ``AttemptLogs`` says, and stopping is SIGTERM -> grace -> SIGKILL.
Improvements over torch: exits wake ``wait()`` at once (pidfds), the whole
process tree is signalled (group, session and descendants, including children
that called ``setsid``), every worker gets ``PR_SET_PDEATHSIG=SIGKILL``, and an
optional :class:`~elaunch.procs.reaper.Reaper` covers ``kill -9`` of the agent.
Which processes make up the trees, orphans the agent adopted included, is
:class:`~elaunch.procs.worker_trees.WorkerTrees`; with a reaper ``wait()`` does no
periodic work at all, without one it snapshots the trees every
``worker_trees.SNAPSHOT_INTERVAL`` seconds.

No torch import here: the agent imports this module.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal as _signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from elaunch.spec import signal_name
from elaunch.supervision import OFF, THREADS, Supervisor

from . import _proctree
from .spawn import _SIGKILL, become_subreaper, marker_entries, popen_worker
from .tee import Tee, follows_for
from .worker_trees import WorkerTrees

if TYPE_CHECKING:
    from .forked import ForkedProcess
    from .logs import AttemptLogs, LogsSpec
    from .reaper import Reaper

log = logging.getLogger(__name__)

#: Seconds to wait for SIGKILLed processes to vanish before giving up on them
#: (a process in uninterruptible sleep cannot die; torch gives up the same way).
KILL_TIMEOUT = 10.0
#: Polling period (seconds) of wait() where pidfds are unavailable.
FALLBACK_POLL = 0.05


class WorkerProcesses:
    """The running workers of one attempt, keyed by local rank. Build with :meth:`start`.

    Call from the agent's main thread: ``PR_SET_PDEATHSIG`` fires when the *thread*
    that started a worker ends.

    Attributes:
        pids: local rank -> worker pid (also its process group and session id).
    """

    def __init__(self, procs: dict[int, subprocess.Popen], tee: Tee, trees: WorkerTrees,
                 supervisor: Supervisor | None = None, started_at: float | None = None) -> None:
        self._procs = procs
        self._supervisor = supervisor
        self.pids = {lr: p.pid for lr, p in procs.items()}
        #: ``time.monotonic()`` once every worker was started or handed its rank (:meth:`start` passes it)
        self.started_at = time.monotonic() if started_at is None else started_at
        self._tee = tee
        self._codes: dict[int, int | None] = dict.fromkeys(procs)
        self._times: dict[int, float] = {}
        self._reported: set[int] = set()
        self._trees = trees
        self._stopped = False
        self._closed = False
        self._pidfds: dict[int, int] = {}
        for lr, pid in self.pids.items():
            try:
                self._pidfds[lr] = os.pidfd_open(pid)
            except (AttributeError, OSError):  # no pidfds: wait() polls instead
                for fd in self._pidfds.values():
                    os.close(fd)
                self._pidfds = {}
                break
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @classmethod
    def start(
        cls,
        cmds: dict[int, list[str]],
        envs: dict[int, dict[str, str]],
        logs: "AttemptLogs",
        spec: "LogsSpec | None" = None,
        prefixes: dict[int, str] | None = None,
        reaper: "Reaper | None" = None,
        adopt: "Callable[[int, list[str], dict[str, str]], subprocess.Popen | ForkedProcess | None] | None" = None,
        supervisor: Supervisor | None = None,
    ) -> "WorkerProcesses":
        """Start one worker per local rank, all before waiting on any.

        Args:
            cmds: local rank -> argv.
            envs: local rank -> the worker's FULL environment.
            logs: destinations from ``RunLogDir.attempt`` (files, tee, error files).
            spec: the LogsSpec (its choices are already reflected in ``logs``).
            prefixes: local rank -> console prefix of tee'd lines (``[default0]:``).
            reaper: watchdog to register the workers with, or None.
            adopt: ``(local_rank, argv, env) -> Popen or None``: a process already
                started (a warm spare, see ``elaunch.procs.warm``) that now runs this
                worker, or None to start it here; or a forked worker
                (``elaunch.procs.forked.ForkedProcess``, ``Popen``'s interface).
            supervisor: the agent's (``elaunch.supervision``): it runs the console copy (tee) of
                this attempt, until :meth:`close`; None: the copy runs on its own.

        Raises:
            ValueError: ``cmds`` and ``envs`` name different local ranks (names both).
            OSError: a worker could not be started (e.g. FileNotFoundError naming the
                program); workers already started are killed first.
        """
        if set(cmds) != set(envs):
            raise ValueError(f"cmds local ranks {sorted(cmds)} != envs local ranks {sorted(envs)}")
        prefixes = prefixes or {}
        procs: dict[int, subprocess.Popen] = {}
        # before a worker can leave orphans behind: they come to the agent, not init
        subreaper = reaper is not None and become_subreaper()
        try:
            for lr in sorted(cmds):
                adopted = adopt(lr, cmds[lr], envs[lr]) if adopt is not None else None
                p = procs[lr] = adopted or popen_worker(cmds[lr], envs[lr], logs.stdout.get(lr), logs.stderr.get(lr))
                if reaper is not None:
                    # at once, not after the rest started: a kill -9 of the agent from here
                    # on takes this worker's tree with it (a repeated watch is harmless)
                    reaper.watch([p.pid], {p.pid: marker_entries(envs[lr])})
            started_at = time.monotonic()
            log.info("started workers %s", {lr: p.pid for lr, p in procs.items()})
            tee = Tee(
                follows_for(logs.tee_stdout, sys.stdout, prefixes)
                + follows_for(logs.tee_stderr, sys.stderr, prefixes, logs.unprefixed)
            )
            if supervisor is not None:
                supervisor.add(tee, THREADS, on_death=OFF, wakes=False, start=True,
                               note="worker output is not copied to the console any more")
            else:
                tee.start()
            trees = WorkerTrees({lr: p.pid for lr, p in procs.items()},
                                [marker_entries(envs[lr]) for lr in procs], reaper, subreaper)
            self = cls(procs, tee, trees, supervisor, started_at)
        except BaseException:
            for p in procs.values():
                _proctree.killpg([p.pid], _SIGKILL)
                p.wait()
            raise
        return self

    # ---------------------------------------------------------------- watching

    def _refresh(self) -> None:
        for lr, p in self._procs.items():
            if self._codes[lr] is None:
                code = p.poll()
                if code is not None:
                    self._codes[lr] = code
                    self._times[lr] = time.time()
                    fd = self._pidfds.pop(lr, None)
                    if fd is not None:
                        os.close(fd)

    def _unreported(self) -> bool:
        new = {lr for lr, c in self._codes.items() if c is not None} - self._reported
        self._reported |= new
        return bool(new)

    def poll(self) -> dict[int, int | None]:
        """Return local rank -> exit code (None while running; ``-signum`` if killed by a signal)."""
        self._refresh()
        self._unreported()
        return dict(self._codes)

    def seen_codes(self) -> dict[int, int | None]:
        """Local rank -> exit code as of the last :meth:`poll` (None: running then); no system call, no reaping.

        For a reader in another thread (``--metrics-port``'s scrape): :meth:`poll` reaps the
        workers, which stays the agent's main thread's job.
        """
        return dict(self._codes)

    def exit_times(self) -> dict[int, float]:
        """Return local rank -> ``time.time()`` when its exit was first seen (exited ranks only)."""
        self._refresh()
        return dict(self._times)

    def wait(self, timeout: float | None) -> bool:
        """Block until a worker exits or ``timeout`` seconds pass (None: no limit).

        Wakes at once on a worker exit (pidfds; short polling where unavailable) or
        on :meth:`wakeup`. A Python signal handler runs promptly during the wait,
        whichever thread the signal reached (called from the main thread, the wait
        is the interpreter's signal wakeup fd meanwhile), and if it raises, the
        exception propagates.

        Returns:
            True if a worker exit not yet reported by ``poll``/``wait`` was seen, or no
            worker is running; False on timeout, wakeup or a handled signal.
        """
        deadline = float("inf") if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            self._refresh()
            if self._unreported() or all(c is not None for c in self._codes.values()):
                return True
            now = time.monotonic()
            if now >= self._trees.next_snapshot:
                self._trees.snapshot(self._unreaped_groups())
            if now >= deadline:
                return False
            step = min(deadline, self._trees.next_snapshot) - now
            if self._block(None if step == float("inf") else max(step, 0.0)):
                self._refresh()
                return self._unreported() or all(c is not None for c in self._codes.values())

    def _block(self, seconds: float | None) -> bool:
        """Sleep up to ``seconds`` (None: until an event); True if woken by :meth:`wakeup` or a signal."""
        if not self._pidfds:
            time.sleep(FALLBACK_POLL if seconds is None else min(seconds, FALLBACK_POLL))
            return self._drain_wakeup()
        # A signal that reached another thread (the tee's, the keep-alive's) would not end
        # select() here: as the wakeup fd, the wake pipe makes it, and the handler then runs.
        main = threading.current_thread() is threading.main_thread()
        previous = _signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False) if main else -1
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._wake_r, selectors.EVENT_READ)
                for lr, fd in self._pidfds.items():
                    if self._codes[lr] is None:
                        sel.register(fd, selectors.EVENT_READ)
                sel.select(seconds)
        finally:
            if main:
                _signal.set_wakeup_fd(previous)
        return self._drain_wakeup()

    def _drain_wakeup(self) -> bool:
        woke = False
        try:
            while os.read(self._wake_r, 512):
                woke = True
        except (BlockingIOError, OSError):
            pass
        return woke

    def wakeup(self) -> None:
        """Make a current or the next ``wait()`` return False at once. Async-signal-safe."""
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def _family(self) -> dict[int, _proctree.Proc]:
        return self._trees.family(self._unreaped_groups())

    def release(self, local_ranks: "list[int]") -> "dict[int, subprocess.Popen]":
        """Let go of the running workers ``local_ranks`` without stopping them; return their processes.

        In-process restart (:mod:`elaunch.inprocess`) keeps them across the next round, while
        this attempt's other workers are stopped as usual: from now on :meth:`poll`, :meth:`wait`,
        :meth:`stop` and :meth:`close` know only the others, and the reaper forgets only those
        at the stop (a released worker is watched again once the next attempt adopts it).

        Raises:
            ValueError: a rank in ``local_ranks`` is not a running worker of this attempt.
        """
        self._refresh()
        gone = [lr for lr in local_ranks if lr not in self._procs or self._codes[lr] is not None]
        if gone:
            raise ValueError(f"local ranks {gone} are not running workers of this attempt")
        out = {}
        for lr in local_ranks:
            out[lr] = self._procs.pop(lr)
            self._codes.pop(lr)
            self._reported.discard(lr)
            fd = self._pidfds.pop(lr, None)
            if fd is not None:
                os.close(fd)
            self._trees.drop([self.pids.pop(lr)])
        return out

    # ---------------------------------------------------------------- stopping

    def _unreaped_groups(self) -> list[int]:
        # A pid not yet reaped cannot be reused, so its group id is still ours.
        return [self.pids[lr] for lr, c in self._codes.items() if c is None]

    def signal(self, sig: int) -> None:
        """Deliver ``sig`` once to every process of every worker's tree (group, session, descendants)."""
        self._refresh()
        self._send(self._family(), sig)

    def notify(self, sig: int, local_ranks: "list[int] | None" = None) -> None:
        """Send ``sig`` to the process group of each running worker (all, or ``local_ranks``).

        For notices the workers handle (a forwarded SIGUSR1) and for killing hung
        workers: one ``killpg`` per worker, no scan of the process table, so it is
        cheap enough for a signal handler.
        """
        self._refresh()
        groups = [self.pids[lr] for lr, c in self._codes.items()
                  if c is None and (local_ranks is None or lr in local_ranks)]
        _proctree.killpg(groups, sig)

    def stop(self, sig: int = _signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop every worker tree: ``sig``, up to ``grace`` seconds, then SIGKILL; reap. Idempotent.

        Mirrors torch's ``PContext.close(death_sig, timeout)`` but covers whole trees.
        Returns as soon as no process of any tree is alive (polling every <= 0.1 s),
        or after ``KILL_TIMEOUT`` more seconds if some process cannot die (logged).
        """
        if self._stopped:
            return
        self._refresh()
        fam = self._family()
        if _proctree.live(fam.values()):
            self._send(fam, sig)
            left = self._await_gone(fam, time.monotonic() + max(0.0, grace), sig)
            if left:
                if sig != _SIGKILL:
                    log.warning("workers did not exit within %.1fs of %s; sending SIGKILL", grace, _name(sig))
                left = self._await_gone(left, time.monotonic() + KILL_TIMEOUT, _SIGKILL, first=True)
                if left:
                    log.error("processes %s survived SIGKILL for %.1fs; abandoning them", sorted(left), KILL_TIMEOUT)
        for p in self._procs.values():
            try:
                p.wait(1.0)
            except subprocess.TimeoutExpired:
                log.error("worker %d could not be reaped", p.pid)
        self._refresh()
        self._trees.release()
        self._stopped = True

    def _send(self, fam: dict[int, _proctree.Proc], sig: int, groups: bool = True) -> None:
        """Deliver ``sig`` once to each process of ``fam``: one ``killpg`` per running worker's group
        (``groups``), and ``kill`` to each member outside those groups (a descendant that left with
        ``setsid``). A member of a worker's group is not sent it again: a script that saves on the first
        SIGTERM and quits at once on a second one, or cleans up under ``except KeyboardInterrupt``, must
        get one, as under torchrun (one ``killpg`` per worker). Only a SIGKILL goes to every member too.
        ``groups=False``: members found after the groups were signalled (those of the groups have it)."""
        worker_groups = set(self._unreaped_groups())
        if groups:
            _proctree.killpg(worker_groups, sig)
        _proctree.kill([p for p in fam.values() if sig == _SIGKILL or p.pgid not in worker_groups], sig)

    def _await_gone(self, fam: dict, deadline: float, sig: int, first: bool = False) -> dict:
        """Wait until ``fam`` and newly found tree members are gone; signal newcomers with ``sig``."""
        if first:
            self._send(fam, sig)
        signalled = {p.key for p in fam.values()}
        delay, last_scan = 0.002, time.monotonic()
        while True:
            self._refresh()
            alive = _proctree.live(fam.values())
            now = time.monotonic()
            if not alive or now - last_scan > 0.5:
                fam = self._family()
                last_scan = now
                new = {pid: p for pid, p in fam.items() if p.key not in signalled}
                if new:
                    self._send(new, sig, groups=False)
                    signalled.update(p.key for p in new.values())
                alive = _proctree.live(fam.values())
                if not alive:
                    return {}
            if now >= deadline:
                return {p.pid: p for p in alive}
            pause = min(delay, max(0.0, deadline - now))
            if self._pidfds and any(self._codes[lr] is None for lr in self._pidfds):
                self._block(pause)  # a worker's exit wakes this at once (pidfd)
            else:
                time.sleep(pause)
            delay = min(delay * 2, 0.1)

    def close(self) -> None:
        """``stop(SIGKILL, 0)``, then finish the console copy and release fds. Idempotent."""
        if self._closed:
            return
        self.stop(_SIGKILL, 0.0)
        if self._supervisor is not None and self._supervisor.has(self._tee):
            self._supervisor.stop(self._tee)  # the final copy, then the thread ends
        else:
            self._tee.stop()
        for fd in [*self._pidfds.values(), self._wake_r, self._wake_w]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds = {}
        self._closed = True

    def __enter__(self) -> "WorkerProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _name(sig: int) -> str:
    return signal_name(-sig)
