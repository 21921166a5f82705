"""elaunch's results as torch's exception classes, for the Python API (``elaunch.run``, ``elaunch.launcher``).

torch is imported only inside these functions, when a job has failed or was
signalled, so importing the API stays light.
"""

from __future__ import annotations

import functools
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


@functools.cache
def child_failed_error_class() -> type:
    """The class elaunch's Python API raises when workers failed: torch's ``ChildFailedError`` and
    :class:`elaunch.errors.ChildFailedError` both, so ``except`` of either catches it. Made once (torch is
    imported then); reachable as ``elaunch.errors.as_torch.ChildFailedError``, so an instance pickles.

    ``ChildFailedError(name, failures, elaunch_failures=None, root_rank=None)``: ``failures`` holds torch
    ``ProcessFailure`` objects keyed by global rank, as torch's; ``elaunch_failures`` elaunch's, which
    ``format_msg()`` formats as elaunch's failure summary (the table the ``elaunch`` command prints; without
    them torch's table); ``get_first_failure()`` returns ``root_rank``'s failure (the rendezvous' job-wide
    root cause, not only the earliest local timestamp) when it is among ``failures``.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError as TorchChildFailedError

    from elaunch.errors.summary import ChildFailedError as ElaunchChildFailedError
    from elaunch.errors.summary import format_failure_summary

    class ChildFailedError(TorchChildFailedError, ElaunchChildFailedError):
        def __init__(self, name: str, failures: dict, elaunch_failures: dict | None = None,
                     root_rank: int | None = None) -> None:
            self.name, self.failures = name, failures
            self.elaunch_failures = dict(elaunch_failures or {})
            self.root_rank = root_rank
            Exception.__init__(self, self.format_msg())  # str(exc): the table, as torch's

        def __reduce__(self):
            return type(self), (self.name, self.failures, self.elaunch_failures, self.root_rank)

        def get_first_failure(self):
            if self.root_rank in self.failures:
                return self.root_rank, self.failures[self.root_rank]
            return TorchChildFailedError.get_first_failure(self)

        def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
            if not self.elaunch_failures:
                return TorchChildFailedError.format_msg(self, boarder_delim, section_delim)
            return format_failure_summary(self.elaunch_failures, title=f"{self.name} FAILED", first=self.root_rank)

    ChildFailedError.__module__ = __name__
    ChildFailedError.__qualname__ = "ChildFailedError"
    return ChildFailedError


def __getattr__(name: str) -> Any:
    if name == "ChildFailedError":  # made on first use: importing this module does not import torch
        return child_failed_error_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def child_failed_error(name: str, result: Any) -> Exception:
    """The :func:`child_failed_error_class` exception for a failed RunResult (torch's ``ChildFailedError``, a subclass)."""
    return child_failed_error_class()(name, {rank: _torch_process_failure(f) for rank, f in result.failures.items()},
                                      result.failures, result.root_rank)


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
