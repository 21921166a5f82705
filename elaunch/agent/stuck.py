"""Workers stuck in uninterruptible sleep: torch's ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``.

A worker that stays in Linux's uninterruptible sleep (state ``D`` in
``/proc/<pid>/stat``: a wedged GPU driver call, a dead NFS server) that many
seconds holds a kernel resource a restarted worker on the same host would fight
for, so torch 2.13's agent then ends the job without restarts. elaunch does the
same, and reports it as a failure of the job (torchrun marks the group
UNHEALTHY, then exits 0). Only read when the variable is set to a positive
number; one small ``/proc`` read per live worker per ``--monitor-interval``.
Stdlib only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

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
    """How long each worker has been in uninterruptible sleep without a break.

    Args:
        timeout: seconds in state ``D`` after which a worker is stuck (> 0).
        read_state: pid -> state letter or None (``proc_state``; injectable for tests).
        clock: monotonic seconds.
    """

    def __init__(self, timeout: float, read_state: Callable[[int], str | None] = proc_state,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._read_state = read_state
        self._clock = clock
        self._since: dict[int, float] = {}  # pid -> when it was first seen in D, this stretch

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


def stuck_failures(workers, stuck: Mapping[int, float], final: Mapping[int, int | None], timeout: float,
                   hostname: str) -> dict:
    """Return the ``ProcessFailure`` of each stuck worker, keyed by global rank.

    Args:
        workers: the group's ``Worker`` objects.
        stuck: local rank -> seconds it was in state D (``UninterruptibleWatch.stuck``).
        final: local rank -> exit code once the group was stopped (None: it could not be reaped).
        timeout: the variable's value, seconds.
        hostname: this node's name.
    """
    from elaunch.spec import ProcessFailure

    out = {}
    for w in workers:
        if w.local_rank not in stuck:
            continue
        code = final.get(w.local_rank)
        out[w.global_rank] = ProcessFailure(
            local_rank=w.local_rank, global_rank=w.global_rank, pid=w.pid or -1,
            exitcode=code if code else -9, timestamp=time.time(), hostname=hostname,
            detail=(f"stuck in uninterruptible sleep (D state) for {stuck[w.local_rank]:.1f} s "
                    f"(>= {ENV}={timeout:g} s): the job ends without restarts, as under torchrun"))
    return out
