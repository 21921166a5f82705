"""Workers stuck in uninterruptible sleep: torch's ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``.

A worker that stays in Linux's uninterruptible sleep (state ``D`` in
``/proc/<pid>/stat``: a wedged GPU driver call, a dead NFS server) that many
seconds holds a kernel resource a restarted worker on the same host would fight
for, so torch 2.13's agent then ends the job without restarts. elaunch does the
same, and reports it as a failure of the job (torchrun marks the group
UNHEALTHY, then exits 0). Only read when the variable is set to a positive
number; one small ``/proc`` read per live worker per ``--monitor-interval``.
:class:`UninterruptibleWatch` is a :class:`~elaunch.agent.watchdog.Watchdog`.
Stdlib only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from elaunch.agent.watchdog import Alarm, Watched
from elaunch.spec import ProcessFailure

log = logging.getLogger("elaunch.agent")

#: The variable torch's ``LocalElasticAgent`` reads (seconds; unset, unparsable or <= 0: off).
ENV = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"


def timeout_from_env(environ: Mapping[str, str]) -> float:
    """Seconds of :data:`ENV` in ``environ``; 0.0 (off) when unset, unparsable or not positive, as torch."""
    raw = environ.get(ENV, "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if value > 0 else 0.0  # nan and -inf are off too


def proc_state(pid: int) -> str | None:
    """The one-letter scheduler state of ``pid`` (``"R"``, ``"S"``, ``"D"``...), None when it is gone."""
    from elaunch.procs._proctree import read

    row = read(pid)
    return None if row is None else row.state


class UninterruptibleWatch:
    """How long each worker has been in uninterruptible sleep without a break: a watchdog.

    Attributes:
        polls: True: the states are read every ``--monitor-interval``.
        interval: None: no shorter interval.

    Args:
        timeout: seconds in state ``D`` after which a worker is stuck (> 0).
        read_state: pid -> state letter or None (``proc_state``; injectable for tests).
        clock: monotonic seconds.
        hostname: this node's name, for failures.
    """

    def __init__(self, timeout: float, read_state: Callable[[int], str | None] = proc_state,
                 clock: Callable[[], float] = time.monotonic, hostname: str = "") -> None:
        self.timeout = timeout
        self.hostname = hostname
        self._read_state = read_state
        self._clock = clock
        self._since: dict[int, float] = {}  # pid -> when it was first seen in D, this stretch
        self.polls = True
        self.interval = None

    def env(self, local_rank: int) -> dict[str, str]:
        """No variables: the watch reads ``/proc``."""
        return {}

    def new_attempt(self, round: int) -> None:
        """Nothing to forget: a new worker's pid starts its own stretch."""

    def close(self) -> None:
        """Nothing to release."""

    def poll(self, watched: Watched) -> Alarm | None:
        """An alarm (no restart; each failure takes its worker's exit code after the stop) for the stuck workers."""
        running = {lr: pid for lr, pid in watched.pids.items() if watched.codes.get(lr) is None}
        stuck = self.stuck(running)
        if not stuck:
            return None
        for lr, dwell in sorted(stuck.items()):
            log.error("worker pid=%d (local rank %d) stuck in uninterruptible sleep (D state) for %.1f s (>= %g s); "
                      "the job ends without restarts", running[lr], lr, dwell, self.timeout)
        failures = {}
        for w in watched.group.workers:
            if w.local_rank in stuck:
                failures[w.global_rank] = ProcessFailure(
                    local_rank=w.local_rank, global_rank=w.global_rank, pid=w.pid or -1, exitcode=-9,
                    timestamp=time.time(), hostname=self.hostname,
                    detail=(f"stuck in uninterruptible sleep (D state) for {stuck[w.local_rank]:.1f} s "
                            f"(>= {ENV}={self.timeout:g} s): the job ends without restarts, as under torchrun"))
        return Alarm("stuck", failures, restart=False, exit_codes_after_stop=True,
                     quiet_seconds=max(stuck.values()))

    def stuck(self, pids: Mapping[int, int]) -> dict[int, float]:
        """Return local rank -> seconds in D for the workers stuck now (empty: none).

        Args:
            pids: local rank -> pid of the workers still running.
        """
        now = self._clock()
        out: dict[int, float] = {}
        live = set(pids.values())
        for pid in [p for p in self._since if p not in live]:
            del self._since[pid]  # exited (or another attempt): forget it
        for local_rank, pid in pids.items():
            if self._read_state(pid) != "D":
                self._since.pop(pid, None)
                continue
            dwell = now - self._since.setdefault(pid, now)
            if dwell >= self.timeout:
                out[local_rank] = dwell
        return out

