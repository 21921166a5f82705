"""``python -m elaunch.status ...``: the ``elaunch status`` subcommand."""

from elaunch.status.cli import run

if __name__ == "__main__":
    run()
