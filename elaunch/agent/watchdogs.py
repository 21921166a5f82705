"""The agent's watchdogs for one run, in the order the monitor polls them.

torch's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER``), stuck (D-state) workers
(``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``), the progress files' watch (the
``training``/``caught_up`` events; always), hangs (``--hang-timeout``) and stragglers
(the ``straggler_*`` rdzv-conf keys): each is a :class:`~elaunch.agent.watchdog.Watchdog`
that the monitor polls and that returns failures. The agent adds the checks of its
helpers (:class:`HelperChecks`) and its checkpoint keeper after them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from elaunch.agent.hang_watchdog import HangWatchdog
from elaunch.agent.progress_watch import ProgressWatchdog, open_progress_watch
from elaunch.agent.stuck import UninterruptibleWatch, timeout_from_env
from elaunch.agent.watchdog import Watchdog

if TYPE_CHECKING:
    from elaunch.config import LaunchConfig
    from elaunch.rendezvous.contract import RendezvousHandler


def open_watchdogs(config: "LaunchConfig", local_world_size: int, rdzv: "RendezvousHandler", events,
                   hostname: str, base_env: Mapping[str, str],
                   interval: float, reaper=None, supervisor=None) -> tuple[ProgressWatchdog | None, list[Watchdog]]:
    """Create this run's watchdogs (some create files: call once the log directory exists).

    ``interval`` is the monitor's (``--monitor-interval``, seconds). ``reaper``: the
    agent's watchdog process (``procs.reaper.Reaper``), which removes the workers'
    progress files' directory if the agent is killed (``kill -9``), or None. ``supervisor``: the
    run's ``elaunch.supervision.Supervisor``, which owns the straggler watch's thread (required
    when the ``straggler_*`` keys are on).

    Returns:
        ``(progress, watchdogs)``: the progress files' watch (None when the files could not be
        made and ``--hang-timeout`` is off), and every watchdog in polling order.

    Raises:
        OSError: the progress files cannot be made while ``--hang-timeout`` is on, or torch's
            file timer's FIFO cannot be created.
    """
    local_ranks = range(local_world_size)
    stuck_after = timeout_from_env(base_env)
    progress = open_progress_watch(local_ranks, events, interval, required=config.hang_timeout > 0)
    if progress is not None and reaper is not None:
        reaper.remove_on_exit(progress.files.directory)
    hang = HangWatchdog(config.hang_timeout, local_ranks, rdzv, hostname, progress=progress)
    stuck = [UninterruptibleWatch(stuck_after, hostname=hostname)] if stuck_after else []
    watchdogs = [*_file_timer(base_env), *stuck, *([progress] if progress is not None else []), hang]
    if config.stragglers.on and progress is not None:
        from elaunch.agent.straggler_watch import StragglerWatch

        watchdogs.append(StragglerWatch(config.stragglers, lambda: progress.files, rdzv.job_channel, events,
                                        hostname, supervisor, min_nodes=config.min_nodes))
    return progress, watchdogs


class HelperChecks:
    """The agent's helpers' health at each look of the monitor: ``elaunch.supervision.Supervisor.check_all``.

    A watchdog that never raises an alarm: a helper whose policy is to report raises its
    ``HelperDied`` out of the monitor; one whose policy is off is stopped with a warning.
    It polls while a watched helper runs (the checkpoint persister, the replica service).

    Args:
        supervisor: the run's ``Supervisor`` (the launcher's); the launcher stops it, not :meth:`close`.
    """

    interval = None

    def __init__(self, supervisor) -> None:
        self._supervisor = supervisor

    @property
    def polls(self) -> bool:
        """True while a helper the monitor must check runs."""
        return self._supervisor.polls

    def env(self, local_rank: int) -> dict[str, str]:
        """Nothing for the workers."""
        return {}

    def new_attempt(self, round: int) -> None:
        """Nothing: the helpers live across attempts."""

    def poll(self, watched=None) -> None:
        """Check every watched helper and apply its policy; never an alarm.

        Raises:
            OSError: a helper whose policy is to report died (``HelperDied``).
        """
        self._supervisor.check_all()

    def close(self) -> None:
        """Nothing: the launcher's close stops the helpers."""


def _file_timer(base_env: Mapping[str, str]) -> list[Watchdog]:
    """torch's hang guard: with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``, a watchdog serving ``FileTimerClient`` scopes.

    Its ``env`` gives the workers the FIFO's path; without it a set
    ``TORCHELASTIC_TIMER_FILE`` reaches them with the rest of the environment, as under torch.
    """
    if "TORCHELASTIC_ENABLE_FILE_TIMER" not in base_env:
        return []  # the usual case: not even the module is loaded
    from elaunch.agent.file_timer import FileTimerWatchdog, file_timer_env

    enabled, path = file_timer_env(base_env)
    return [FileTimerWatchdog(path)] if enabled else []
