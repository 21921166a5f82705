"""The job secret: what the nodes of one job share that nobody outside it has (stdlib only).

``ELAUNCH_JOB_SECRET`` (the secret itself) or ``ELAUNCH_JOB_SECRET_FILE`` (a file holding
it: a Kubernetes or Slurm secret mounted as a file; one trailing newline is dropped).
Every node of the job must be given the same one. With it, the agents' replica services
authenticate each other with a key derived from it (``checkpoint.replica_wire.job_key``), and
no key is published in the rendezvous; without it, each agent makes a random key and
publishes it in the round's inventory exchange, which protects against whoever cannot
read the rendezvous store, no more (docs/checkpointing.md, "Security"). No torchrun
counterpart: torchrun's agents never talk to each other outside the store.
"""

from __future__ import annotations

from collections.abc import Mapping

from elaunch.config.errors import ConfigError

ENV_SECRET, ENV_SECRET_FILE = "ELAUNCH_JOB_SECRET", "ELAUNCH_JOB_SECRET_FILE"
MIN_BYTES = 16  #: a shorter secret is refused: it could be guessed


def job_secret(environ: Mapping[str, str]) -> bytes | None:
    """The job secret from ``environ`` (see the module docstring), or None when neither variable is set.

    Raises:
        ConfigError: both variables are set, the file cannot be read, or the secret is
            shorter than :data:`MIN_BYTES` bytes; the message names the variable (never the secret).
    """
    value, path = environ.get(ENV_SECRET), environ.get(ENV_SECRET_FILE)
    if value is not None and path is not None:
        raise ConfigError(f"{ENV_SECRET} and {ENV_SECRET_FILE} are both set: set one")
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read()
        except OSError as exc:
            raise ConfigError(f"{ENV_SECRET_FILE}={path}: cannot read it ({exc.strerror or exc})") from None
        secret, name = secret[:-1] if secret.endswith(b"\n") else secret, f"{ENV_SECRET_FILE}={path}"
    elif value is not None:
        secret, name = value.encode("utf-8", "surrogateescape"), ENV_SECRET
    else:
        return None
    if len(secret) < MIN_BYTES:
        raise ConfigError(f"{name}: the secret is {len(secret)} bytes; at least {MIN_BYTES} are needed "
                          f"(e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret
