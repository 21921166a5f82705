"""Worker failures between this node and the job: to and from the rendezvous' FailureRecord.

Pure conversions (no processes, no I/O): a local :class:`~elaunch.spec.ProcessFailure`
becomes the :class:`~elaunch.rendezvous.api.FailureRecord` that every agent of the
job reads, and a record published by another node becomes a ``ProcessFailure``
marked ``remote`` for this node's failure summary. Stdlib only.
"""

from __future__ import annotations

from elaunch.rendezvous.api import FailureRecord
from elaunch.spec import ProcessFailure


def to_record(failure: ProcessFailure, round: int, text: str, at: float, hung: bool = False) -> FailureRecord:
    """Return the record of a local failure for the rendezvous.

    Args:
        failure: the failure as this agent saw it.
        round: the rendezvous round of the failed group.
        text: what the summary shows as its traceback (``errors.failure_text``).
        at: when it happened, seconds since the epoch (``errors.failure_time``).
        hung: True when the worker was stopped for making no progress.
    """
    return FailureRecord(round=round, at=at, host=failure.hostname, rank=failure.global_rank,
                         local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
                         message=text, hung=hung)


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
