"""``python -m elaunch.runpath SCRIPT [ARGS]...``: run SCRIPT with ``runpy.run_path``.

Emulates torchrun's ``--run-path``: torchrun calls ``runpy.run_path(script,
run_name="__main__")`` inside each worker it forks. elaunch workers are
separate processes started from an argv, so ``--run-path`` makes that argv
``python -u -m elaunch.runpath SCRIPT ARGS...``, and this module performs the
same ``run_path`` with ``sys.argv = [SCRIPT, *ARGS]``.

Under torchrun such a worker is a function worker: once the script returned it
waits until every local worker's script returned (``MultiprocessContext``), so
none exits while a sibling is still inside its last collective. Started by
elaunch with more than one local worker, this module waits the same way
(:mod:`elaunch.procs.return_barrier`); run without elaunch, it never waits.

torchrun's function worker calls ``run_script_path`` under torch's ``@record``, so
an exception the script raises is written to the worker's
``TORCHELASTIC_ERROR_FILE`` (torch's JSON format) before it propagates; this module
does the same with :mod:`elaunch.errors.record`, imported only once the script
raised (35-45 ms of imports measured; a script that succeeds never pays them).
Stdlib only.
"""

from __future__ import annotations

import faulthandler
import runpy
import sys


def run(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` (torch ``run_script_path``).

    When elaunch started this process as one of several local workers, a script that
    returned (or raised ``SystemExit`` with status 0 or None) then waits until every
    local sibling returned too, or died; as torch's ``_wrap`` waits on
    ``queue_finished_reading_event``. A script that raised does not wait.

    As under torch's ``@record`` (torchrun's function worker): ``faulthandler`` is
    enabled before the script runs, and an ``Exception`` the script raises is
    written to ``TORCHELASTIC_ERROR_FILE`` (when set) before it propagates; for
    ``ChildFailedError`` (a nested launch failed: elaunch's, or torch's when torch's
    launcher is loaded) the root cause's error file is copied there instead. ``SystemExit`` and
    ``KeyboardInterrupt`` are not recorded.

    Args:
        argv: the script's path, then its arguments.

    Raises:
        SystemExit: with status 2 when no script is given; whatever the script raises.
    """
    if not argv:
        sys.stderr.write("usage: python -m elaunch.runpath SCRIPT [ARGS]...\n")
        raise SystemExit(2)
    from elaunch.procs import return_barrier

    held = return_barrier.claim()
    sys.argv = list(argv)
    _enable_faulthandler()
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        return_barrier.arrive(held)
        raise
    except Exception as exc:
        _record(exc)
        raise
    return_barrier.arrive(held)


def _enable_faulthandler() -> None:
    """``ErrorHandler.initialize()`` of ``@record`` without importing it: tracebacks of all threads on SIGSEGV."""
    try:
        faulthandler.enable(all_threads=True)
    except Exception as exc:  # e.g. sys.stderr replaced by an object without fileno
        import warnings

        warnings.warn(f"Unable to enable fault handler. {type(exc).__name__}: {exc}", stacklevel=2)


def _record(exc: Exception) -> None:
    """What ``@record`` does with an ``Exception``: write it, or a nested launch's root cause, to the error file."""
    from elaunch.errors.record import ErrorHandler, record_failure

    record_failure(exc, ErrorHandler())

if __name__ == "__main__":
    run(sys.argv[1:])
