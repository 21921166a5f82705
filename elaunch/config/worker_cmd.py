"""The worker's command: what each worker process runs, checked before anything starts.

Mirrors the argv part of ``torch.distributed.run.config_from_args`` (python
``-u``, ``-m``, ``--no-python``, ``--run-path``) plus elaunch's ``--warm-start``
module list. Stdlib only.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping

from elaunch.config.errors import ConfigError
from elaunch.config.options import DEFAULT_WARM_MODULES


def build_cmd(
    script: str,
    script_args: tuple[str, ...] | list[str] = (),
    *,
    module: bool = False,
    no_python: bool = False,
    run_path: bool = False,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """Build the worker argv as torchrun does (``config_from_args``).

    * python: ``($PYTHON_EXEC or sys.executable, "-u", ["-m",] script, *args)``;
    * ``--no-python``: ``(script, *args)``;
    * ``--run-path``: ``(python, "-u", "-m", "elaunch.runpath", script, *args)``.
      torchrun runs the script with ``runpy.run_path`` inside its own worker
      process; elaunch workers are separate processes, so the tiny
      ``elaunch.runpath`` module does the same ``run_path`` there. It takes
      precedence over ``--no-python`` and ``-m``, as in torchrun.

    Raises:
        ConfigError: ``--no-python`` with ``-m``; a script that python cannot run (no such
            file, a directory without ``__main__.py``, unreadable; not checked with ``-m``);
            with ``--no-python``, a program that is neither an existing path nor found on
            ``PATH``, or a path that is a directory or not executable.
    """
    env = os.environ if environ is None else environ
    python = env.get("PYTHON_EXEC") or sys.executable
    args = tuple(script_args)
    if run_path:
        _require_file(script)
        return (python, "-u", "-m", "elaunch.runpath", script, *args)
    if no_python:
        if module:
            raise ConfigError("--no-python and -m/--module cannot be used together")
        if os.sep not in script and not shutil.which(script, path=env.get("PATH", os.defpath)):
            raise ConfigError(f"{script}: program not found on PATH")
        if os.sep in script and not os.path.exists(script):
            raise ConfigError(f"{script}: no such file")
        if os.sep in script and (os.path.isdir(script) or not os.access(script, os.X_OK)):
            why = "a directory" if os.path.isdir(script) else "not executable"
            raise ConfigError(f"{script}: {why} (--no-python runs it as a program)")
        return (script, *args)
    if module:
        return (python, "-u", "-m", script, *args)
    _require_file(script)
    return (python, "-u", script, *args)


def _require_file(script: str) -> None:
    """``script`` is what python runs as a script: a readable file (a zip file too), or a directory holding
    ``__main__.py`` (``python dir``, as under torchrun).

    Raises:
        ConfigError: no such file, a directory without ``__main__.py``, or a file that cannot be read.
    """
    if os.path.isdir(script):
        main = os.path.join(script, "__main__.py")
        if not os.path.isfile(main):
            raise ConfigError(f"{script}: a directory without __main__.py (training script)")
    elif os.path.isfile(script):
        main = script
    else:
        raise ConfigError(f"{script}: no such file (training script)")
    try:
        with open(main, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{main}: cannot be read ({exc.strerror or exc}) (training script)") from None


_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def warm_start_modules(
    on: bool, modules: tuple[str, ...], no_python: bool
) -> tuple[tuple[str, ...] | None, list[str]]:
    """Resolve ``--warm-start``/``--warm-start-modules`` (elaunch flags, no torchrun equivalent).

    Args:
        on: the ``--warm-start`` flag; modules: module names or empty for the default
            (:data:`~elaunch.config.options.DEFAULT_WARM_MODULES`);
        no_python: ``--no-python`` given (warm start then does not apply).

    Returns:
        ``(names, warnings)``: the module names to pre-import, or None when warm start
        is off or inapplicable; and the lines to log (the flag ignored).

    Raises:
        ConfigError: a name that is not a dotted Python module name.
    """
    if not on:
        return None, []
    names = tuple(modules) if modules else DEFAULT_WARM_MODULES
    for name in names:
        if not _MODULE_RE.match(name):
            raise ConfigError(f"--warm-start-modules={','.join(names)}: {name!r} is not a module name")
    if no_python:
        return None, ["--warm-start does not apply to --no-python workers; ignored"]
    return names, []
