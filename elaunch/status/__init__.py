"""``elaunch status``: a job's rendezvous read without joining it (round, nodes, restarts, failure, stacks).

``main(argv) -> int`` is the subcommand (``elaunch.cli.subcommands``); see
``docs/status.md`` for the table, the ``--json`` schema and ``--stacks``.
"""

from elaunch.status.cli import main

__all__ = ["main"]
