"""The ``elaunch`` command: torchrun's flags, parsed with click into LaunchOptions, then a LaunchConfig.

``main`` is the click command (console script ``elaunch`` and ``python -m
elaunch``), its options derived from the option table
(``elaunch.config.options.OPTIONS``). Every option has its torchrun dash spelling, the underscore alias
(``--nproc_per_node``) and a ``PET_<DEST>`` environment fallback; the command
line wins over the environment, which wins over the default, as torchrun's
``env``/``check_env`` argparse actions. Everything after the training script
belongs to the script.

Bad input is reported as one line ``elaunch: error: <flag>=<value>: <reason>``
on stderr with exit status 2 (no usage block, no traceback). No torch import
here: ``--nproc-per-node gpu|xpu|auto`` imports it lazily in ``elaunch.config``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import click
from click.core import ParameterSource

from elaunch import __version__
from elaunch.cli import params as P
from elaunch.config import EXIT_USAGE, OPTIONS, ConfigError, LaunchConfig, LaunchOptions, build_config
from elaunch.config.options import GROUPS, Option
from elaunch.log import setup_logging
from elaunch.rendezvous.contract import RendezvousConfigError

__all__ = ["main", "parse_config", "run_argv"]

class PetOption(click.Option):
    """An option with a ``PET_<DEST>`` fallback read from the command's explicit environ.

    The environment is the mapping given to ``parse_config`` (stored as the root
    context's ``obj``), falling back to ``os.environ``; an empty value counts as unset.
    Help shows only the dash spelling; the underscore alias still parses.
    """

    def __init__(self, decls: Sequence[str], group: str = "Other", **attrs: Any) -> None:
        dest = decls[-1]
        attrs.setdefault("envvar", f"PET_{dest.upper()}")
        attrs.setdefault("show_envvar", True)
        attrs.setdefault("show_default", attrs.get("default") not in (None, False, ""))
        super().__init__(decls, **attrs)
        self.group = group

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        environ = ctx.find_root().obj
        if not isinstance(environ, Mapping):
            environ = os.environ
        value = environ.get(self.envvar) if isinstance(self.envvar, str) else None
        return value if value else None

    def get_help_record(self, ctx: click.Context):
        saved = self.opts
        self.opts = [o for o in saved if "_" not in o] or saved
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = saved


#: Options elaunch adds to torchrun's: they take no abbreviation (see ``elaunch.cli.abbrev``).
ELAUNCH_ONLY_OPTIONS = frozenset({*(o.dest for o in OPTIONS.values() if o.elaunch_only), "version"})


def option_tables(command: click.Command) -> tuple[list[str], set[str], set[str]]:
    """Return ``(torchrun_long_options, all_option_strings, value_taking_option_strings)``.

    ``torchrun_long_options`` lists, in declaration order, the long spellings of the
    options torchrun has too, and ``--help``: the strings an abbreviation may expand to.
    """
    torchrun: list[str] = []
    known: set[str] = set()
    valued: set[str] = set()
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        opts = [*param.opts, *param.secondary_opts]
        known.update(opts)
        if not param.is_flag:
            valued.update(opts)
        if param.name not in ELAUNCH_ONLY_OPTIONS:
            torchrun.extend(o for o in opts if o.startswith("--"))
    known.update(("-h", "--help"))
    return [*torchrun, "--help"], known, valued


class ElaunchCommand(click.Command):
    """A click command that groups options in --help and reports errors in one line.

    Abbreviated long options are expanded first, as torchrun's argparse parser
    does (``--redirect=3`` is ``--redirects=3``; see ``elaunch.cli.abbrev``).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from elaunch.cli.abbrev import AmbiguousOptionError, expand_abbreviations

        try:
            args = expand_abbreviations(args, *option_tables(self))
        except AmbiguousOptionError as exc:
            raise click.UsageError(str(exc), ctx) from None
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {g: [] for g in GROUPS}
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                rows.setdefault(getattr(param, "group", "Other"), []).append(record)
        for group, records in rows.items():
            if records:
                with formatter.section(group):
                    formatter.write_dl(records)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> Any:
        """Run ``elaunch`` with ``args`` (default ``sys.argv[1:]``) and exit with its status.

        Run as the program (no ``args``) after torch was loaded (the c10d backend),
        the exit skips the interpreter's teardown of torch (about 0.3 s, seconds under
        load): by then the workers are stopped, the rendezvous is left and every line
        is written, so the job's other nodes see this one finish sooner.
        """
        argv = sys.argv[1:] if args is None else list(args)
        from elaunch.cli.subcommands import pick

        subcommand = pick(argv)
        status = run_argv(argv) if subcommand is None else subcommand(argv[1:])
        if args is None and "torch" in sys.modules:
            from elaunch.log import fast_exit

            fast_exit(status)
        sys.exit(status)


def _click_option(o: Option) -> Callable[[Any], Any]:
    """The click option of row ``o`` of the option table."""
    if o.is_flag:
        return click.option(*o.flags, o.dest, cls=PetOption, group=o.group, is_flag=True, default=False,
                            type=P.PetFlag(), show_default=False, help=o.help)
    typed = {"type": P.PARSED} if o.parse is not None else {}
    return click.option(*o.flags, o.dest, cls=PetOption, group=o.group, default=o.default if o.shown is None
                        else o.shown, metavar=o.metavar, help=o.help, **typed)


def _table_options(command: Any) -> Any:
    """Decorate ``command`` with every row of the option table, in the table's order."""
    for o in reversed(OPTIONS.values()):
        command = _click_option(o)(command)
    return command


_CONTEXT = {
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
    "max_content_width": 100,
}


@click.command(
    cls=ElaunchCommand,
    context_settings=_CONTEXT,
    epilog="Every --dash-option also accepts its --under_score spelling. Bad input exits with status 2.",
)
@click.version_option(__version__, "--version", prog_name="elaunch", message="%(prog)s %(version)s")
@_table_options
@click.argument("training_script", required=False, metavar="SCRIPT")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
def main(**options: Any) -> LaunchConfig:
    """Launch SCRIPT on this node as a group of workers: a drop-in replacement for torchrun.

    SCRIPT (a Python file, a module with -m, or a program with --no-python) and
    everything after it are passed to each worker untouched.
    """
    ctx = click.get_current_context()
    # a default is LaunchOptions' to fill in (build_config resolves --forward-signals' and --shutdown-timeout's)
    given = {k: v for k, v in options.items() if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
    environ = ctx.find_root().obj
    return build_config(LaunchOptions(**given), environ if isinstance(environ, Mapping) else os.environ)


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchConfig:
    """Parse ``argv`` (without the program name) into a LaunchConfig, reading ``environ``.

    Pure apart from logging and the filesystem/PATH check of the script.

    Raises:
        ConfigError: a bad value; the message names it.
        click.UsageError: an unknown option or a missing option value.
        click.exceptions.Exit: ``--help`` or ``--version`` was handled (exit_code 0).
    """
    with main.make_context("elaunch", list(argv), obj=environ) as ctx:
        return main.invoke(ctx)


def _error(message: str) -> int:
    line = " ".join(str(message).split())
    click.echo(f"elaunch: error: {line}", err=True)
    return EXIT_USAGE


def run_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Parse ``argv``, launch, and return the exit status (torchrun's ``main`` minus the exit).

    Returns:
        0 on success (or after --help/--version); 2 for bad input, after printing
        one line ``elaunch: error: ...`` on stderr; otherwise ``launch``'s status.
    """
    env = os.environ if environ is None else environ
    setup_logging(env)
    try:
        config = parse_config(argv, env)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        return _error(exc.format_message())
    except (ConfigError, RendezvousConfigError) as exc:
        return _error(str(exc))
    from elaunch.launch import launch

    try:
        return launch(config)
    except (ConfigError, RendezvousConfigError) as exc:
        return _error(str(exc))
