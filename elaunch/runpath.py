"""``python -m elaunch.runpath SCRIPT [ARGS]...``: run SCRIPT with ``runpy.run_path``.

Emulates torchrun's ``--run-path``: torchrun calls ``runpy.run_path(script,
run_name="__main__")`` inside each worker it forks. elaunch workers are
separate processes started from an argv, so ``--run-path`` makes that argv
``python -u -m elaunch.runpath SCRIPT ARGS...``, and this module performs the
same ``run_path`` with ``sys.argv = [SCRIPT, *ARGS]``. Stdlib only.
"""

from __future__ import annotations

import runpy
import sys


def run(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` (torch ``run_script_path``).

    Raises:
        SystemExit: with status 2 when no script is given; whatever the script raises.
    """
    if not argv:
        sys.stderr.write("usage: python -m elaunch.runpath SCRIPT [ARGS]...\n")
        raise SystemExit(2)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    run(sys.argv[1:])
