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
Stdlib only.
"""

from __future__ import annotations

import runpy
import sys


def run(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` (torch ``run_script_path``).

    When elaunch started this process as one of several local workers, a script that
    returned (or raised ``SystemExit`` with status 0 or None) then waits until every
    local sibling returned too, or died; as torch's ``_wrap`` waits on
    ``queue_finished_reading_event``. A script that raised does not wait.

    Raises:
        SystemExit: with status 2 when no script is given; whatever the script raises.
    """
    if not argv:
        sys.stderr.write("usage: python -m elaunch.runpath SCRIPT [ARGS]...\n")
        raise SystemExit(2)
    from elaunch.procs import return_barrier

    held = return_barrier.claim()
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        return_barrier.arrive(held)
        raise
    return_barrier.arrive(held)


if __name__ == "__main__":
    run(sys.argv[1:])
