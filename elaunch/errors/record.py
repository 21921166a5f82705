"""The ``@record`` decorator: a worker's uncaught exception → its error file.

Stdlib only. Mirrors ``torch.distributed.elastic.multiprocessing.errors.record``
and its ``ErrorHandler`` and writes the same JSON (same keys, same order), so the
agent (ours or torch's) reads files from either decorator::

    {"message": {"message": "ValueError: bad",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

One deliberate difference: the file is written atomically (a temporary file in
the same directory, then ``os.replace``), so a reader never sees half a file.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, TypeVar

from elaunch.errors.errorfile import read_error_file
from elaunch.errors.summary import ChildFailedError

#: Environment variable naming the worker's error file (set by the agent).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_F = TypeVar("_F", bound=Callable[..., Any])


def write_atomic(path: str, dump: Callable[[Any], None], binary: bool = False, prefix: str = ".tmp-") -> None:
    """Write ``path`` atomically: ``dump(file)`` fills a temporary file beside it, then ``os.replace``.

    A reader sees the old file or the whole new one, never a part; the
    temporary file is removed when ``dump`` fails.

    Raises:
        OSError: the directory is not writable; whatever ``dump`` raises.
    """
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fp:
            dump(fp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` atomically (tmp file + ``os.replace``).

    Raises:
        OSError: the directory is not writable.
    """
    write_atomic(path, lambda fp: json.dump(data, fp), prefix=".error-")


def exception_error_data(exc: BaseException, now: float | None = None) -> dict:
    """Return the error-file dict torch's ``ErrorHandler.record_exception`` writes.

    Args:
        exc: the exception (its traceback is taken from ``exc.__traceback__``).
        now: the failure time in seconds since the epoch; default ``time.time()``.
            Stored as a string of whole seconds, as torch does.
    """
    stamp = time.time() if now is None else now
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                "timestamp": str(int(stamp)),
            },
        }
    }


class ErrorHandler:
    """Writes structured errors to ``TORCHELASTIC_ERROR_FILE``.

    Same methods and behaviour as torch's ``ErrorHandler`` (which may be passed to
    :func:`record` instead): without the variable nothing is written.
    """

    def _get_error_file_path(self) -> str | None:
        return os.environ.get(ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Enable ``faulthandler`` (tracebacks of all threads on SIGSEGV & co)."""
        try:
            faulthandler.enable(all_threads=True)
        except Exception as exc:  # e.g. sys.stderr replaced by an object without fileno
            warnings.warn(f"Unable to enable fault handler. {type(exc).__name__}: {exc}", stacklevel=2)

    def record_exception(self, exc: BaseException) -> None:
        """Write ``exc`` (message, traceback, timestamp) to the error file, if one is set."""
        path = self._get_error_file_path()
        if not path:
            return
        try:
            write_json_atomic(path, exception_error_data(exc))
        except OSError as err:
            warnings.warn(f"Unable to write error to file {path}. {type(err).__name__}: {err}", stacklevel=2)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file.

        Used when the decorated function is itself a launcher that raised
        :class:`~elaunch.errors.ChildFailedError`. As in torch, a non-zero
        ``error_code`` (the child's exit code) is stored as ``message.errorCode``
        in torch's shape (the child cannot know it when killed by a signal); the
        older string form is copied unchanged.
        """
        data = read_error_file(rootcause_error_file)
        if data is None:
            return
        if error_code and isinstance(data.get("message"), dict):
            data["message"]["errorCode"] = error_code
        path = self._get_error_file_path()
        if not path:
            return
        try:
            write_json_atomic(path, data)
        except OSError as err:
            warnings.warn(f"Unable to write error to file {path}. {type(err).__name__}: {err}", stacklevel=2)


def get_error_handler() -> ErrorHandler:
    """A new :class:`ErrorHandler` (torch's ``get_error_handler``: the handler ``record`` uses by default)."""
    return ErrorHandler()


def _child_failed_classes() -> tuple[type, ...]:
    """elaunch's ``ChildFailedError`` and, when torch's launcher is loaded (else none of its can exist), torch's."""
    torch_errors = sys.modules.get("torch.distributed.elastic.multiprocessing.errors")
    theirs = getattr(torch_errors, "ChildFailedError", None)
    return (ChildFailedError,) if theirs is None else (ChildFailedError, theirs)


def record_failure(exc: Exception, handler: Any) -> None:
    """What :func:`record` does with an ``Exception`` ``exc``: a ``ChildFailedError`` (a nested launch failed:
    elaunch's, or torch's when torch's launcher is loaded) has its root cause's error file copied with
    ``handler.dump_error_file`` (nothing when that worker wrote none); anything else is written with
    ``handler.record_exception``. ``handler``: an :class:`ErrorHandler` (torch's fits)."""
    if not isinstance(exc, _child_failed_classes()):
        handler.record_exception(exc)
        return
    _, root = exc.get_first_failure()
    if root.error_file and os.path.isfile(root.error_file):
        handler.dump_error_file(root.error_file, root.exitcode)


def record(fn: _F | None = None, error_handler: Any = None):
    """Decorate a worker's entrypoint so an uncaught exception is recorded, then re-raised.

    Mirrors torch's ``@record``: usable as ``@record`` or
    ``@record(error_handler=h)``. On entry, ``error_handler.initialize()`` runs. Then:

    * ``SystemExit`` with code 0 is swallowed and the wrapper returns None
      (``sys.exit(0)`` is success; torch does the same).
    * Any other ``SystemExit`` and ``KeyboardInterrupt`` propagate unrecorded, as in
      torch: the exit code (and, under elaunch, the stderr tail) tells the story.
    * A ``ChildFailedError`` (a nested launcher failed: elaunch's, or torch's own when
      torch's launcher is loaded): the root cause's error file is copied to this process's
      error file, then re-raised.
    * Any other ``Exception``: written to ``TORCHELASTIC_ERROR_FILE`` in torch's
      JSON shape (nothing written when the variable is unset), then re-raised.

    Args:
        fn: the function to wrap.
        error_handler: an object with ``initialize()``, ``record_exception(exc)``
            and ``dump_error_file(path, error_code)``; default :class:`ErrorHandler`.
            torch's ``ErrorHandler`` fits.

    Returns:
        The wrapped function (or a decorator when ``fn`` is None).
    """
    handler = error_handler if error_handler is not None else ErrorHandler()

    def wrap(f: _F) -> _F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except Exception as exc:
                record_failure(exc, handler)
                raise

        return wrapper  # type: ignore[return-value]

    if fn is None:
        return wrap
    return wrap(fn)
