"""Which worker failed first, and the failure table printed when a run fails.

Stdlib only. The table has the shape of torch's ``ChildFailedError`` message
(``torch.distributed.elastic.multiprocessing.errors``)::

    ============================================================
    train.py FAILED
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      time      : 2024-05-01_12:00:00
      host      : node1
      rank      : 1 (local_rank: 1)
      exitcode  : 1 (pid: 4242)
      error_file: /tmp/.../1/error.json
      traceback : Traceback (most recent call last):
        ...
    ------------------------------------------------------------
    Other Failures:
    [1]:
      ...
    ============================================================

Differences, deliberate: the root cause comes first (torch 2.x lists it last,
after "Failures:"); a death by signal says ``Signal 9 (SIGKILL) received by PID
1234``; and when a worker left no error file, the last lines of its stderr are
shown under ``stderr tail`` instead of only a link to the docs; and a worker
that died of SIGABRT with "terminate called without an active exception" in its
stderr tail gets a ``hint`` line (:data:`EXIT_ABORT_HINT`).
"""

from __future__ import annotations

import signal
import socket
from datetime import datetime

from elaunch.errors.errorfile import UNREADABLE_KEY, error_message, error_timestamp, error_traceback
from elaunch.spec import ProcessFailure

_NOT_AVAILABLE = "<N/A>"
_NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
_MAX_WIDTH = 60
#: What std::terminate prints when it ends a process with no exception in flight.
EXIT_ABORT_LINE = "terminate called without an active exception"
#: What the table adds under a worker that died of SIGABRT after printing :data:`EXIT_ABORT_LINE`: a known
#: race of torch's gloo backend at interpreter exit (issue 22; the same under torchrun). A script that never
#: destroyed its process group meets it most, but one that did is not immune (issue 35: an FSDP2 + ``dcp.save``
#: script that destroys its group died of it in 6 of 10 runs under elaunch, 4 of 10 under torchrun), so the
#: hint names the race and what makes it rarer, not a cause. One line of about 120 columns with its label.
EXIT_ABORT_HINT = "a known torch/gloo race at interpreter exit, under torchrun too; destroy_process_group() makes it rarer"


def failure_time(failure: ProcessFailure) -> float:
    """Return when ``failure`` happened, seconds since the epoch.

    When the worker wrote an error file: the file's mtime (``error_time``, the
    moment the exception was recorded) or, without one, the file's own timestamp
    (whole seconds). Otherwise the moment the agent saw the exit.

    Two ranks that both record an error in the same second (the culprit, and a
    peer whose collective then broke) are told apart by ``error_time`` only.
    """
    ts = error_timestamp(failure.error_data)
    if ts is None:
        return failure.timestamp
    return failure.error_time if failure.error_time is not None else ts


def _order(failures: dict[int, ProcessFailure]) -> list[int]:
    return sorted(failures, key=lambda rank: (failure_time(failures[rank]), rank))


def root_cause(failures: dict[int, ProcessFailure]) -> ProcessFailure:
    """Return the first failure: earliest :func:`failure_time`, ties → lowest global rank.

    Mirrors ``ChildFailedError.get_first_failure`` (torch picks the smallest
    timestamp too, but breaks ties by dict order).

    Args:
        failures: failed workers keyed by global rank.

    Raises:
        ValueError: ``failures`` is empty.
    """
    if not failures:
        raise ValueError("root_cause: failures is empty ({})")
    return failures[_order(failures)[0]]


def _indent(text: str, prefix: str) -> str:
    return text.replace("\n", "\n" + prefix)


def _describe(failure: ProcessFailure) -> tuple[str, str]:
    """Return (traceback line, stderr block) for one failure."""
    data = failure.error_data
    stderr_block = ""
    if data is not None:
        tb = error_traceback(data) or error_message(data) or _NOT_AVAILABLE
        if data.get(UNREADABLE_KEY) and failure.stderr_tail:
            stderr_block = _stderr_block(failure.stderr_tail)
        return tb.rstrip("\n"), stderr_block
    if failure.detail:
        tb = failure.detail
    elif failure.exitcode < 0:
        tb = f"Signal {-failure.exitcode} ({failure.signal_name}) received by PID {failure.pid}"
    elif failure.stderr_tail:
        tb = "<N/A> (no error file; decorate the entrypoint with @record to get one)"
    else:
        tb = _NO_TRACEBACK
    if failure.stderr_tail:
        stderr_block = _stderr_block(failure.stderr_tail)
    return tb, stderr_block


def _stderr_block(tail: str) -> str:
    lines = tail.rstrip("\n").split("\n")
    head = f"  stderr tail (last {len(lines)} line{'s' if len(lines) != 1 else ''} of the worker's stderr):"
    return head + "\n" + "\n".join("    " + line for line in lines)


def failure_text(failure: ProcessFailure) -> str:
    """Return what the summary shows of ``failure`` as its traceback (and stderr tail), as one text."""
    tb, stderr_block = _describe(failure)
    return tb + ("\n" + stderr_block if stderr_block else "")


def exit_abort(failure: ProcessFailure) -> bool:
    """Whether ``failure`` is a death by SIGABRT with :data:`EXIT_ABORT_LINE` in its stderr tail."""
    lines = (failure.stderr_tail or "").splitlines()
    return failure.exitcode == -signal.SIGABRT and any(line.strip() == EXIT_ABORT_LINE for line in lines)


def format_failure(idx: int, rank: int, failure: ProcessFailure) -> str:
    """Return one ``[idx]:`` block of the table (no trailing newline)."""
    when = datetime.fromtimestamp(int(failure_time(failure))).isoformat(sep="_")
    sig = f" ({failure.signal_name})" if failure.exitcode < 0 else ""
    tb, stderr_block = _describe(failure)
    lines = [
        f"[{idx}]:",
        f"  time      : {when}",
        f"  host      : {failure.hostname or socket.getfqdn()}"
        + (" (reported by that node's agent through the rendezvous)" if failure.remote else ""),
        f"  rank      : {rank} (local_rank: {failure.local_rank})",
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){sig}",
        # as torch: the path only when the worker wrote the file
        f"  error_file: {failure.error_file if failure.error_data is not None and failure.error_file else _NOT_AVAILABLE}",
        f"  traceback : {_indent(tb, '  ')}",
    ]
    if stderr_block:
        lines.append(stderr_block)
    if exit_abort(failure):
        lines.append(f"  hint      : {EXIT_ABORT_HINT}")
    return "\n".join(lines)


def format_failure_summary(failures: dict[int, ProcessFailure], *, title: str, first: int | None = None) -> str:
    """Return the failure table, root cause first, then the others by time.

    Args:
        failures: failed workers keyed by global rank.
        title: the heading line, e.g. ``"train.py FAILED"`` (used verbatim).
        first: global rank of the root cause when the job decided it (the same on
            every node, possibly another node's worker); None or a rank not in
            ``failures``: the earliest failure (:func:`root_cause`).

    Returns:
        The table, lines joined by ``"\\n"``, without leading or trailing newline.
        Its rules are as wide as the widest line, at most 60 characters (torch's cap).

    Raises:
        ValueError: ``failures`` is empty.
    """
    if not failures:
        raise ValueError("format_failure_summary: failures is empty ({})")
    order = _order(failures)
    if first in failures:
        order = [first] + [rank for rank in order if rank != first]
    blocks = [format_failure(idx, rank, failures[rank]) for idx, rank in enumerate(order)]
    width = max(len(line) for text in [title, *blocks] for line in text.split("\n"))
    width = min(width, _MAX_WIDTH)
    border, section = "=" * width, "-" * width
    others = "\n".join(blocks[1:]) or "  <NO_OTHER_FAILURES>"
    return "\n".join(
        [
            border,
            title,
            section,
            "Root Cause (first observed failure):",
            blocks[0],
            section,
            "Other Failures:",
            others,
            border,
        ]
    )


class ChildFailedError(Exception):
    """Workers failed; the message is the failure table.

    Mirrors torch's ``ChildFailedError(name, failures)``; ``str(exc)`` starts with
    a newline so that ``ChildFailedError: `` is followed by the table's first rule.
    What elaunch's Python API raises (``elastic_launch``, ``elaunch.run.run``) is a
    subclass of this class and of torch's (``elaunch.errors.as_torch.child_failed_error_class``),
    so ``except`` of either catches it.

    Args:
        name: what failed, e.g. the entrypoint ``"train.py"``; the title is
            ``f"{name} FAILED"``.
        failures: failed workers keyed by global rank.

    Raises:
        ValueError: ``failures`` is empty.
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure]):
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}): failures is empty ({{}})")
        self.name = name
        self.failures = dict(failures)
        super().__init__("\n" + self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """Return ``(global_rank, failure)`` of the root cause (see :func:`root_cause`)."""
        rank = _order(self.failures)[0]
        return rank, self.failures[rank]

    def format_msg(self) -> str:
        """Return the failure table (see :func:`format_failure_summary`)."""
        return format_failure_summary(self.failures, title=f"{self.name} FAILED")
