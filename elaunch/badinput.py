"""The error for bad user input, shared by the config and the entrypoint checks (stdlib only)."""


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or env var) and the bad value.

    The CLI prints it as one line ``elaunch: error: <message>`` and exits 2.
    """
