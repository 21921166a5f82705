"""Error reporting: the ``@record`` decorator, error files, root cause, failure table.

Stdlib only: the agent imports this package, and so do workers (``from
elaunch.errors import record``), without pulling in torch. Files written by
:func:`record` have torch's error-file shape, and files written by torch's own
``@record`` are read by :func:`read_error_file`.
"""

from elaunch.errors.errorfile import (
    error_message,
    error_timestamp,
    error_traceback,
    read_error_file,
    tail_file,
)
from elaunch.errors.record import ERROR_FILE_ENV, ErrorHandler, exception_error_data, get_error_handler, record
from elaunch.errors.summary import (
    ChildFailedError,
    failure_text,
    failure_time,
    format_failure,
    format_failure_summary,
    root_cause,
)
from elaunch.spec import ProcessFailure

__all__ = [
    "ERROR_FILE_ENV",
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "error_message",
    "error_timestamp",
    "error_traceback",
    "exception_error_data",
    "failure_text",
    "failure_time",
    "format_failure",
    "format_failure_summary",
    "get_error_handler",
    "read_error_file",
    "record",
    "root_cause",
    "tail_file",
]
