"""The watchdogs' interface: what the monitor polls while a group runs, and what they find.

A watchdog judges running workers by something their exit codes do not show:
``--hang-timeout``'s progress counters (:mod:`elaunch.agent.hang_watchdog`), torch's
``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` (:mod:`elaunch.agent.stuck`), torch's
file timer (:mod:`elaunch.agent.file_timer`). The monitor polls each every
``--monitor-interval`` (or the watchdog's shorter ``interval``) and stops at the
first :class:`Alarm` that fails the group; what follows (the signals, the kill, the
event, the failures reported, whether a restart may fix it) is done in one place,
from the alarm alone. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from elaunch.rendezvous.contract import JobState
from elaunch.spec import ProcessFailure, WorkerGroup

log = logging.getLogger("elaunch.agent")


@dataclass(frozen=True)
class Watched:
    """What a watchdog may look at in one check of a running group.

    Attributes:
        group: the running WorkerGroup (ranks, round, workers with their pids).
        pids: local rank -> worker pid.
        codes: local rank -> exit code, None while running.
        error_files: local rank -> the worker's error file (``TORCHELASTIC_ERROR_FILE``).
        job: the job's shared facts as just read.
        log_root: the run's log directory (stack dumps go under it), or None.
    """

    group: WorkerGroup
    pids: Mapping[int, int]
    codes: Mapping[int, int | None]
    error_files: Mapping[int, str]
    job: JobState
    log_root: str | None


@dataclass(frozen=True)
class Alarm:
    """What a watchdog found: running workers failed (the group fails), or processes to signal.

    Attributes:
        kind: ``"hang"``, ``"stuck"`` (the event log's ``hang`` event, ``stuck=``),
            ``"file_timer"``, ``"straggler"`` (the agent sits out: ``straggler_exclude``) or
            ``"raised"`` (a worker's ``main()`` raised under ``elaunch.restartable``: ``elaunch.inprocess``).
        failures: global rank -> the failure to report; empty when the exit codes and
            error files tell (a quiet rank that wrote its error file is failing, not hung).
        kill: the signal the named workers get at once, before the group is stopped
            (a hung worker may ignore SIGTERM, or be stopped); None: only the stop.
        culprit: the global rank the others wait behind (the root cause), or None.
        blocked: the culprit itself looked blocked behind a peer on another node.
        stopped: the culprit was found stopped (process state ``T``).
        restart: False when no restart can fix it: the job ends at once (torch's
            agent for a worker stuck in D state).
        exit_codes_after_stop: each failure takes its worker's exit code once the
            group is stopped, when that is not 0 (the watchdog's own is the fallback).
        signals: pid -> signal, sent at once to exactly that process (not its group),
            as torch's file timer does.
        fails: False: after the signals the watch goes on, and a worker that dies of
            one is judged by its exit like any other (torch's file timer).
        quiet_seconds: how long the failed workers had made no progress (a hang) or sat
            in D state (stuck) at the verdict, seconds; the ``hang`` event's
            ``quiet_seconds`` (the goodput ledger's hung time). None: unknown.
        why: for ``kind="straggler"`` (no failure: this node sits out, ``straggler_exclude``),
            the reason logged.
    """

    kind: str
    failures: dict[int, ProcessFailure]
    kill: int | None = None
    culprit: int | None = None
    blocked: bool = False
    stopped: bool = False
    restart: bool = True
    exit_codes_after_stop: bool = False
    signals: Mapping[int, int] = dataclasses.field(default_factory=dict)
    fails: bool = True
    quiet_seconds: float | None = None
    why: str = ""

    def reported(self, final: Mapping[int, int | None]) -> dict[int, ProcessFailure]:
        """The failures to report, given local rank -> exit code after the group's stop."""
        if not self.exit_codes_after_stop:
            return dict(self.failures)
        return {g: dataclasses.replace(f, exitcode=final.get(f.local_rank) or f.exitcode)
                for g, f in self.failures.items()}


def send_signals(signals: Mapping[int, int]) -> None:
    """Send each pid its signal (``os.kill``); a pid already gone is skipped, one that cannot be signalled logged."""
    for pid, sig in signals.items():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # already gone
        except (OSError, OverflowError) as exc:
            log.error("cannot send signal %d to pid %d: %s", sig, pid, exc)


class Watchdog(Protocol):
    """One watch over running workers, across the agent's attempts.

    Attributes:
        polls: True when the watch must look while the group runs, not only when a
            child exits (the monitor then looks every ``--monitor-interval``).
        interval: the most seconds between two looks when shorter than
            ``--monitor-interval``, or None.
        look_within: optional (absent: None): when nothing polls, the most seconds until
            the monitor's next look, for a watch that wants a look now and then but not
            every ``--monitor-interval`` (the progress watch waiting for ``training``).
    """

    polls: bool
    interval: float | None

    def env(self, local_rank: int) -> dict[str, str]:
        """Variables ``local_rank``'s worker needs for this watch ({} for none)."""

    def new_attempt(self, round: int) -> None:
        """Forget the last attempt's workers: a new set starts (rendezvous round ``round``)."""

    def poll(self, watched: Watched) -> Alarm | None:
        """Look once; return the alarm when running workers failed, else None."""

    def close(self) -> None:
        """Release what the watch holds (files). Idempotent."""
