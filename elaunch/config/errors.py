"""Bad user input: its error and its exit status, shared by the config, the CLI and the launcher (stdlib only)."""

#: The ``elaunch`` command's exit status for bad user input (as argparse's, torchrun's).
EXIT_USAGE = 2


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or env var) and the bad value.

    The CLI prints it as one line ``elaunch: error: <message>`` and exits :data:`EXIT_USAGE` (2).
    """
