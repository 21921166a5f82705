"""The watchdogs' interface: what the monitor polls while a group runs, and what they find.

A watchdog judges running workers by something their exit codes do not show:
``--hang-timeout``'s progress counters (:mod:`elaunch.agent.hang_response`), torch's
``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` (:mod:`elaunch.agent.stuck`). The
monitor polls each every ``--monitor-interval`` and stops at the first
:class:`Alarm`; what follows (the kill, the event, the failures reported, whether a
restart may fix it) is done in one place, from the alarm alone. Stdlib only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from elaunch.rendezvous.api import JobState
from elaunch.spec import ProcessFailure, WorkerGroup


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
    """Running workers a watchdog found failed: the group fails.

    Attributes:
        kind: ``"hang"`` or ``"stuck"`` (the event log's ``hang`` event, ``stuck=``).
        failures: global rank -> the failure to report; empty when the exit codes and
            error files tell (a quiet rank that wrote its error file is failing, not hung).
        kill: the signal the named workers get at once, before the group is stopped
            (a hung worker may ignore SIGTERM, or be stopped); None: only the stop.
        culprit: the global rank the others wait behind (the root cause), or None.
        blocked: the culprit itself looked blocked behind a peer on another node.
        restart: False when no restart can fix it: the job ends at once (torch's
            agent for a worker stuck in D state).
        exit_codes_after_stop: each failure takes its worker's exit code once the
            group is stopped, when that is not 0 (the watchdog's own is the fallback).
    """

    kind: str
    failures: dict[int, ProcessFailure]
    kill: int | None = None
    culprit: int | None = None
    blocked: bool = False
    restart: bool = True
    exit_codes_after_stop: bool = False

    def reported(self, final: Mapping[int, int | None]) -> dict[int, ProcessFailure]:
        """The failures to report, given local rank -> exit code after the group's stop."""
        if not self.exit_codes_after_stop:
            return dict(self.failures)
        return {g: dataclasses.replace(f, exitcode=final.get(f.local_rank) or f.exitcode)
                for g, f in self.failures.items()}


class Watchdog(Protocol):
    """One watch over running workers, across the agent's attempts."""

    def env(self, local_rank: int) -> dict[str, str]:
        """Variables ``local_rank``'s worker needs for this watch ({} for none)."""

    def new_attempt(self, round: int) -> None:
        """Forget the last attempt's workers: a new set starts (rendezvous round ``round``)."""

    def poll(self, watched: Watched) -> Alarm | None:
        """Look once; return the alarm when running workers failed, else None."""

    def close(self) -> None:
        """Release what the watch holds (files). Idempotent."""
