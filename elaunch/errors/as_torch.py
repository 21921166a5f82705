"""elaunch's results as torch's exception classes, for the Python API (``elaunch.run``, ``elaunch.launcher``).

torch is imported only inside these functions, when a job has failed or was
signalled, so importing the API stays light.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def _torch_process_failure(failure: Any) -> Any:
    """Build torch's ``ProcessFailure`` from elaunch's (same rank, pid, exit code, error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out = ProcessFailure(local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
                         error_file=failure.error_file or "")
    if os.path.isfile(out.error_file):
        return out  # torch read it: message, traceback and timestamp are the error's
    data = failure.error_data
    if isinstance(data, dict):  # the file is gone (a temporary log dir); elaunch kept its data
        out.error_file_data = data
        message = data.get("message")
        if isinstance(message, dict):
            message = message.get("message")
        if message:
            out.message = str(message)
    out.timestamp = int(failure.timestamp)
    return out


def child_failed_error(name: str, result: Any) -> Exception:
    """Return torch's ``ChildFailedError`` (a subclass) for a failed RunResult.

    ``failures`` holds torch ``ProcessFailure`` objects keyed by global rank;
    ``get_first_failure()`` returns elaunch's root cause (the rendezvous' job-wide
    one when known, not only the earliest local timestamp) and ``format_msg()``
    elaunch's failure summary, the table the ``elaunch`` command prints.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError as TorchChildFailedError

    from elaunch.errors import format_failure_summary

    class ChildFailedError(TorchChildFailedError):
        def __init__(self) -> None:
            self.elaunch_failures = dict(result.failures)
            self.root_rank = result.root_rank
            super().__init__(name, {rank: _torch_process_failure(f) for rank, f in result.failures.items()})

        def get_first_failure(self):
            if self.root_rank in self.failures:
                return self.root_rank, self.failures[self.root_rank]
            return super().get_first_failure()

        def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
            return format_failure_summary(self.elaunch_failures, title=f"{self.name} FAILED", first=self.root_rank)

    ChildFailedError.__module__ = __name__
    return ChildFailedError()


def signal_exception(exc: Any) -> Exception:
    """Return torch's ``SignalException`` for elaunch's ``exc`` (``elaunch.agent.SignalException``).

    Its ``sigval`` is a ``signal.Signals``, as torch's.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sig = signal.Signals(exc.sigval)
    return SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def record_in_error_file(exc: Exception) -> None:
    """Write ``exc`` to this process' ``TORCHELASTIC_ERROR_FILE``, as torch's ``@record`` on ``main``.

    For torch's ``ChildFailedError`` the root cause's own error file is copied (with its
    exit code); any other exception is recorded with its traceback.
    """
    from elaunch.errors import ErrorHandler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    handler = ErrorHandler()
    if not isinstance(exc, ChildFailedError):
        handler.record_exception(exc)
        return
    _, failure = exc.get_first_failure()
    if failure.error_file and os.path.isfile(failure.error_file):
        handler.dump_error_file(failure.error_file, failure.exitcode)
