"""``elaunch.run``: torchrun's Python API, as ``torch.distributed.run`` offers it.

The public functions of ``torch.distributed.run`` (torch 2.13), with the same
signatures, return shapes and exceptions::

    from elaunch.run import parse_args, run
    args = parse_args(["--nproc-per-node=2", "train.py", "--lr=0.1"])
    run(args)          # raises torch's ChildFailedError when a worker failed

Exceptions (torch's classes, or subclasses of them):

* ``ValueError`` for bad configuration (``elaunch.config.errors.ConfigError`` and
  ``elaunch.rendezvous.contract.RendezvousConfigError`` are ValueErrors), e.g.
  ``--no-python`` with ``--module`` or ``--nproc-per-node=unknown``;
* ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` (a
  subclass whose ``get_first_failure()`` is elaunch's root cause and whose
  ``format_msg()`` is elaunch's failure summary) when the workers failed;
* ``torch.distributed.elastic.multiprocessing.api.SignalException`` when a
  handled signal (``--signals-to-handle``) stopped the job;
* ``SystemExit(2)`` from ``parse_args`` for an unknown or ambiguous option, as
  argparse's.

``parse_args`` returns torchrun's ``argparse.Namespace`` shape: the same
attribute names and value types as torch's parser (``nnodes="1:1"``,
``nproc_per_node="1"``, ``max_restarts=0``, ``rdzv_conf=""``, ...), plus
elaunch's own flags (the ``elaunch_only`` rows of the option table,
``elaunch.config.options.OPTIONS``). ``config_from_args`` accepts that Namespace (or any object
with those attributes; a missing one takes the default) and returns elaunch's
:class:`elaunch.config.LaunchConfig`, whose fields carry torch's ``LaunchConfig``
names. The ``elaunch`` command does not use this module's exceptions: it prints
one ``elaunch: error:`` line (exit 2), the failure summary (exit 1) or exits
``128 + signum`` (``python -m elaunch.run`` is that command too).

torch is imported only when a job fails or is signalled (to build its exception
classes), so ``import elaunch.run`` stays light.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from elaunch.config.errors import ConfigError

__all__ = [
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]

class _ArgumentParser(argparse.ArgumentParser):
    """argparse, with torchrun's abbreviations resolved by ``elaunch.cli.abbrev``.

    Built with ``allow_abbrev=False``: the abbreviations argparse would accept
    among torchrun's options are expanded before parsing (``--redirect=3``), and
    elaunch's own options take none, exactly as the ``elaunch`` command.
    """

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw["allow_abbrev"] = False
        self._elaunch_only: set[str] = set()
        self._registered: list[argparse.Action] = []
        super().__init__(*a, **kw)

    def add_argument(self, *a: Any, **kw: Any) -> argparse.Action:
        action = super().add_argument(*a, **kw)
        self._registered.append(action)
        return action

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        from elaunch.cli.abbrev import AmbiguousOptionError, expand_abbreviations

        argv = sys.argv[1:] if args is None else list(args)
        torchrun: list[str] = []
        known: set[str] = {"-h", "--help"}
        valued: set[str] = set()
        for action in self._registered:
            known.update(action.option_strings)
            if action.nargs != 0:
                valued.update(action.option_strings)
            if action.dest not in self._elaunch_only:
                torchrun.extend(o for o in action.option_strings if o.startswith("--"))
        try:
            argv = expand_abbreviations(argv, [*torchrun, "--help"], known, valued)
        except AmbiguousOptionError as exc:
            self.error(str(exc))  # SystemExit(2), as argparse's own "ambiguous option"
        return super().parse_known_args(argv, namespace)


def get_args_parser() -> argparse.ArgumentParser:
    """Return the ``argparse`` parser for torchrun's flags plus elaunch's own.

    Mirrors ``torch.distributed.run.get_args_parser()``: the same option strings
    (dash and ``--under_score`` spellings), ``dest`` names and value types; the
    defaults fall back to ``PET_<DEST>`` read from ``os.environ`` now, as torch's
    ``env``/``check_env`` actions (an empty value counts as unset; a flag's
    ``PET_`` value must be an integer, non-zero meaning set). The options are
    derived from the option table (``elaunch.config.options.OPTIONS``), as the
    ``elaunch`` command's are, so both always agree.

    Returns:
        An ``argparse.ArgumentParser``; ``parse_args`` on it returns the Namespace
        described in the module docstring.

    Raises:
        ConfigError: a flag's ``PET_<FLAG>`` is not an integer (a ValueError;
            torch raises ValueError from ``int()`` there too).
    """
    from elaunch.config.options import OPTIONS, comma_list
    from elaunch.config.values import parse_pet_flag

    parser = _ArgumentParser(description="elaunch: a drop-in replacement for torchrun (Torch Distributed Elastic Training Launcher)")
    for o in OPTIONS.values():
        raw = os.environ.get(o.envvar)
        if o.elaunch_only:
            parser._elaunch_only.add(o.dest)
        if o.is_flag:
            flag_default = parse_pet_flag(raw, o.envvar) if raw else False
            parser.add_argument(*o.flags, dest=o.dest, action="store_const", const=True, default=flag_default,
                                help=o.help)
            continue
        default = raw if raw else o.default
        if o.argtype is comma_list and isinstance(default, str):
            default = comma_list(default)
        parser.add_argument(*o.flags, dest=o.dest, type=o.argtype, default=default, choices=o.choices, help=o.help)
    parser.add_argument("training_script", type=str, help="The training script, module (-m) or program (--no-python).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """Parse torchrun's command line (without the program name) into a Namespace.

    Mirrors ``torch.distributed.run.parse_args(args)``; ``None`` parses ``sys.argv[1:]``.

    Raises:
        SystemExit: status 2 after argparse's usage message, for an unknown, ambiguous
            or incomplete option or a missing training script; status 0 after ``--help``.
    """
    return get_args_parser().parse_args(args)


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """Split ``--nnodes`` (``"N"`` or ``"MIN:MAX"``) into ``(min_nodes, max_nodes)``.

    Mirrors ``torch.distributed.run.parse_min_max_nnodes``: only the format is checked
    here (``"4:1"`` gives ``(4, 1)``); ``config_from_args`` checks the bounds.

    Raises:
        RuntimeError: more than one ``:``.
        ValueError: a part is not an integer.
    """
    parts = nnodes.split(":")
    if len(parts) > 2:
        raise RuntimeError(f'nnodes={nnodes} is not in "MIN:MAX" format')
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--nnodes={nnodes}: expected N or MIN:MAX with integer N, MIN, MAX") from None
    return bounds[0], bounds[-1]


def determine_local_world_size(nproc_per_node: str) -> int:
    """Return the number of workers ``--nproc-per-node`` asks for on this host.

    Mirrors ``torch.distributed.run.determine_local_world_size``: an integer string
    is returned as an int unchecked; ``cpu`` counts the CPUs this process may use,
    ``gpu`` CUDA devices, ``xpu`` XPU devices, ``auto`` accelerators else CPUs.
    (torch also accepts its privateuse1 backend's name; elaunch does not.)

    Raises:
        ValueError: an unknown keyword, or ``gpu``/``xpu`` without such a device
            (a ``ConfigError`` naming the flag).
    """
    from elaunch.config import resolve_nproc

    try:
        return int(nproc_per_node)
    except ValueError:
        pass
    return resolve_nproc(nproc_per_node)


def get_rdzv_endpoint(args: Any) -> str:
    """Return ``args.rdzv_endpoint``, or ``"master_addr:master_port"`` for static without one.

    Mirrors ``torch.distributed.run.get_rdzv_endpoint`` (no brackets are added to
    an IPv6 ``master_addr``; ``config_from_args`` adds them).
    """
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return args.rdzv_endpoint


def get_use_env(args: Any) -> bool:
    """Return ``args.use_env``, True when absent (``torch.distributed.launch``'s legacy flag).

    Mirrors ``torch.distributed.run.get_use_env``. elaunch always passes the ranks
    in the environment; a False value is accepted and has no effect.
    """
    return getattr(args, "use_env", True)


def config_from_args(args: Any) -> tuple[Any, Callable[..., None] | str, list[str]]:
    """Build the launch configuration and the worker command from parsed args.

    Mirrors ``torch.distributed.run.config_from_args``, and also applies what torch's
    ``run`` does first (``--standalone`` and a single-node static job without an
    endpoint get a local rendezvous on a free port; ``master_port`` defaults to 29500).

    Args:
        args: what :func:`parse_args` returns (torch's ``parse_args`` result works
            too); missing attributes take torchrun's defaults.

    Returns:
        ``(config, cmd, cmd_args)``: an :class:`elaunch.config.LaunchConfig` (torch's
        ``LaunchConfig`` field names: ``min_nodes``, ``max_nodes``,
        ``nproc_per_node``, ``run_id``, ``rdzv_backend``, ``rdzv_configs``, ...); and,
        as torch, ``cmd`` the python executable (``$PYTHON_EXEC`` or
        ``sys.executable``) with ``cmd_args`` ``["-u", ["-m",] script, *script_args]``,
        or ``cmd`` the program and ``cmd_args`` its args with ``--no-python``, or
        ``cmd`` :func:`run_script_path` and ``cmd_args`` ``[script, *script_args]``
        with ``--run-path``.

    Raises:
        ValueError: a bad value or combination (``ConfigError``, naming the flag),
            e.g. ``--no-python`` with ``--module``, ``--nproc-per-node=unknown``,
            ``--nnodes=4:1`` or ``--max-restarts=-1`` (torch raises AssertionError
            for the last two), or a training script that does not exist.
        RuntimeError: ``--nnodes`` with more than one ``:``.
    """
    from elaunch.config import LaunchOptions, build_config

    if isinstance(getattr(args, "nnodes", None), str):
        parse_min_max_nnodes(args.nnodes)  # torch's RuntimeError for "1:2:3"
    config = build_config(LaunchOptions.from_namespace(args), os.environ)
    if getattr(args, "run_path", False):
        return config, run_script_path, [args.training_script, *getattr(args, "training_script_args", ())]
    return config, config.cmd[0], list(config.cmd[1:])


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` in this interpreter as ``__main__`` with ``sys.argv`` set.

    Mirrors ``torch.distributed.run.run_script_path`` (``runpy.run_path``); the
    ``--run-path`` workers run it through ``python -m elaunch.runpath``.
    """
    from elaunch.runpath import run as run_path

    run_path([training_script, *training_script_args])


def run(args: Any) -> None:
    """Run the job ``args`` describes on this node; return when it succeeded.

    Mirrors ``torch.distributed.run.run(args)`` (which hands the config to
    ``elastic_launch``). A node the rendezvous does not need returns normally.

    Args:
        args: what :func:`parse_args` returns.

    Raises:
        ValueError: bad configuration (see :func:`config_from_args`), also a
            rendezvous backend rejecting its ``--rdzv-conf``.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: the
            workers failed (after ``--max-restarts`` restarts).
        torch.distributed.elastic.multiprocessing.api.SignalException: a handled
            signal stopped the job; ``sigval`` is the ``signal.Signals`` received.
        elaunch.rendezvous.contract.RendezvousError: the rendezvous failed.
    """
    from elaunch.agent import SignalException as ElaunchSignalException
    from elaunch.errors.as_torch import child_failed_error, signal_exception
    from elaunch.launch import entrypoint_name, run_job

    config, _, _ = config_from_args(args)
    try:
        result = run_job(config)
    except ElaunchSignalException as exc:
        raise signal_exception(exc) from exc
    if result is not None and result.is_failed():
        raise child_failed_error(entrypoint_name(config.cmd), result)


def main(args: Sequence[str] | None = None) -> None:
    """Parse ``args`` (default ``sys.argv[1:]``) and run the job: ``run(parse_args(args))``.

    Mirrors ``torch.distributed.run.main(args)``; raises what :func:`parse_args` and
    :func:`run` raise. The ``elaunch`` command (``elaunch.cli.main``) is the one that
    turns these into exit statuses. As torch's ``main`` (decorated with ``@record``),
    when this process has a ``TORCHELASTIC_ERROR_FILE`` (it runs as another agent's
    worker), a failure is written there before it propagates: the root cause's
    error file for ``ChildFailedError``, else the exception.
    """
    try:
        run(parse_args(args))
    except Exception as exc:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            from elaunch.errors.as_torch import record_in_error_file

            record_in_error_file(exc)
        raise


if __name__ == "__main__":
    from elaunch.cli import main as _command

    _command()
