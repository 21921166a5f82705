"""``elaunch.run.main``: the programmatic entry point, as ``torch.distributed.run.main``.

Example::

    from elaunch.run import main
    main(["--nproc-per-node=2", "train.py", "--lr=0.1"])
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``) like torchrun and run the job.

    Mirrors ``torch.distributed.run.main(args)``.

    Args:
        argv: the command line without the program name.

    Returns:
        None when the job succeeded (exit status 0).

    Raises:
        SystemExit: with the non-zero exit status otherwise (2 for bad input,
            after one ``elaunch: error: ...`` line on stderr).
    """
    from elaunch.cli import run_argv

    status = run_argv(sys.argv[1:] if argv is None else list(argv))
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
