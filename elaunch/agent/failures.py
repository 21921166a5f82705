"""Worker failures: collected after an attempt, and between this node and the job.

:func:`collect_failures` reads what the failed workers left (error files, stderr
tails). The rest are pure conversions: a local :class:`~elaunch.spec.ProcessFailure`
becomes the :class:`~elaunch.rendezvous.contract.FailureRecord` that every agent of the
job reads, and a record published by another node becomes a ``ProcessFailure``
marked ``remote`` for this node's failure summary. Stdlib only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from elaunch.rendezvous.contract import FailureRecord
from elaunch.spec import ProcessFailure, signal_name


def to_record(failure: ProcessFailure, round: int, text: str, at: float, hung: bool = False,
              blocked: bool = False, stopped: bool = False) -> FailureRecord:
    """Return the record of a local failure for the rendezvous.

    Args:
        failure: the failure as this agent saw it.
        round: the rendezvous round of the failed group.
        text: what the summary shows as its traceback (``errors.failure_text``).
        at: when it happened, seconds since the epoch (``errors.failure_time``).
        hung: True when the worker was stopped for making no progress.
        blocked: True for a hung worker that itself waited on a peer (see ``FailureRecord``).
        stopped: True for a hung worker found stopped (process state ``T``).
    """
    return FailureRecord(round=round, at=at, host=failure.hostname, rank=failure.global_rank,
                         local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
                         message=text, hung=hung, blocked=blocked, stopped=stopped)


def from_record(record: FailureRecord) -> ProcessFailure:
    """Return another node's published failure as a ``ProcessFailure`` (``remote=True``)."""
    return ProcessFailure(local_rank=record.local_rank, global_rank=record.rank, pid=record.pid,
                          exitcode=record.exitcode, timestamp=record.at, hostname=record.host,
                          remote=True, detail=record.message)


def with_root(failures: dict[int, ProcessFailure], root: FailureRecord, me: str) -> dict[int, ProcessFailure]:
    """Return ``failures`` plus the job's root cause when another node (not ``me``) published it.

    Args:
        failures: this node's failures, keyed by global rank.
        root: the job's root cause, from the rendezvous.
        me: this node's rendezvous id (``root.node`` is the publisher's).
    """
    if root.node == me or root.rank in failures:
        return dict(failures)
    return {**failures, root.rank: from_record(root)}


def collect_failures(workers, codes: Mapping[int, int | None], times: Mapping[int, float],
                     final: Mapping[int, int | None], logs, hostname: str) -> dict[int, ProcessFailure]:
    """Return the failed workers of one attempt, keyed by global rank (reads error files and stderr tails).

    Args:
        workers: the group's ``Worker`` objects.
        codes: local rank -> exit code when the failure was seen (None: running).
        times: local rank -> when its exit was seen, seconds since the epoch.
        final: local rank -> exit code after the group was stopped.
        logs: the attempt's ``AttemptLogs`` (error files, stderr files).
        hostname: this node's name.
    """
    from elaunch.errors import read_error_file, tail_file  # only on failure: keeps start-up light

    out: dict[int, ProcessFailure] = {}
    for w in workers:
        code = codes.get(w.local_rank)
        error_file = logs.error_file[w.local_rank]
        data = read_error_file(error_file)
        if code is None or code == 0:
            # Still running when the failure was seen. If it wrote an error file it
            # failed on its own (often first: a peer then crashed on its closed
            # socket before this one finished exiting), so it is reported too.
            if not data or data.get("unreadable"):
                continue
            code = final.get(w.local_rank) or 1
        stderr_path = logs.stderr.get(w.local_rank)
        out[w.global_rank] = ProcessFailure(
            local_rank=w.local_rank,
            global_rank=w.global_rank,
            pid=w.pid or -1,
            exitcode=code,
            timestamp=times.get(w.local_rank, time.time()),
            hostname=hostname,
            error_file=error_file,
            error_data=data,
            stderr_tail=tail_file(stderr_path) if data is None or data.get("unreadable") else "",
            error_time=_mtime(error_file) if data else None,
        )
    return out


def _mtime(path: str) -> float | None:
    """Return ``path``'s modification time in seconds (float), None if it is gone."""
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


def describe_exits(codes: Mapping[int, int | None], raised: Mapping[int, str] | None = None) -> str:
    """``"local rank 0: exitcode 1, local rank 1: SIGTERM"`` for the workers that failed.

    Args:
        codes: local rank -> exit code (None: running).
        raised: local rank -> the exception an ``elaunch.restartable`` worker reported
            (``"RuntimeError: ..."``); such a rank is alive (its code 1 or None) and is described
            as ``"raised RuntimeError"``, not as the exit code it never had.
    """
    raised = raised or {}
    parts = []
    for lr, code in sorted(codes.items()):
        if lr in raised and code in (None, 1):
            parts.append(f"local rank {lr}: raised {raised[lr].split(':', 1)[0]}")
            continue
        if code is None or code == 0:
            continue
        what = signal_name(code) if code < 0 else f"exitcode {code}"
        parts.append(f"local rank {lr}: {what}")
    return ", ".join(parts)
