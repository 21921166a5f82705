"""The ``elaunch`` command: torchrun's flags, parsed with click into LaunchOptions, then a LaunchConfig.

``main`` is the click command (console script ``elaunch`` and ``python -m
elaunch``). Every option has its torchrun dash spelling, the underscore alias
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
from collections.abc import Mapping, Sequence
from typing import Any

import click
from click.core import ParameterSource

from elaunch import __version__
from elaunch.cli import params as P
from elaunch.config import (
    DEFAULT_FORWARD_SIGNALS,
    DEFAULT_SIGNALS,
    EXIT_USAGE,
    ConfigError,
    LaunchConfig,
    LaunchOptions,
    build_config,
)
from elaunch.log import setup_logging
from elaunch.rendezvous.api import RendezvousConfigError
from elaunch.rendezvous.registry import user_backend_names

__all__ = ["main", "parse_config", "run_argv"]

_NODES, _RDZV, _WORKERS, _LOGS, _STATIC = (
    "Nodes and workers",
    "Rendezvous",
    "Worker launch",
    "Logging and output",
    "Static rendezvous (torch.distributed.launch compatibility)",
)
_GROUPS = (_NODES, _RDZV, _WORKERS, _LOGS, _STATIC, "Other")


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
ELAUNCH_ONLY_OPTIONS = frozenset({"warm_start", "warm_start_modules", "hang_timeout", "forward_signals", "version"})


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
        rows: dict[str, list[tuple[str, str]]] = {g: [] for g in _GROUPS}
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


def _opt(*decls: str, group: str, **attrs: Any):
    return click.option(*decls, cls=PetOption, group=group, **attrs)


def _flag(*decls: str, group: str, help: str):
    return click.option(*decls, cls=PetOption, group=group, is_flag=True, default=False,
                        type=P.PetFlag(), show_default=False, help=help)


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
@_opt("--nnodes", "nnodes", group=_NODES, type=P.PARSED, default="1:1", metavar="N|MIN:MAX",
      help="Number of nodes, or the range MIN:MAX for an elastic job.")
@_opt("--nproc-per-node", "--nproc_per_node", "nproc_per_node", group=_NODES, type=P.PARSED, default="1",
      metavar="N|auto|cpu|gpu|xpu",
      help="Workers per node: an integer, or cpu (usable CPUs), gpu (CUDA devices), xpu, "
           "auto (accelerators if any, else CPUs).")
@_opt("--rdzv-backend", "--rdzv_backend", "rdzv_backend", group=_RDZV, type=P.PARSED, default="static",
      metavar="BACKEND", help=f"Rendezvous backend: {', '.join(user_backend_names())}, "
                            "or a name registered in the 'torchrun.handlers' entry-point group.")
@_opt("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", group=_RDZV, default="", metavar="HOST[:PORT]",
      help="Rendezvous endpoint, host[:port] ([::1]:29400 for IPv6; etcd: a comma-separated list).")
@_opt("--rdzv-id", "--rdzv_id", "rdzv_id", group=_RDZV, default="none", metavar="ID",
      help="Job id shared by all nodes of the job (TORCHELASTIC_RUN_ID).")
@_opt("--rdzv-conf", "--rdzv_conf", "rdzv_conf", group=_RDZV, type=P.PARSED, default="", metavar="K=V,...",
      help="Backend options, e.g. join_timeout=600,last_call_timeout=30 (timeouts in seconds).")
@_flag("--standalone", "standalone", group=_RDZV,
       help="Single-node job with a local rendezvous on a free port; any rendezvous backend, endpoint and id flags are ignored.")
@_opt("--max-restarts", "--max_restarts", "max_restarts", group=_WORKERS, type=P.PARSED, default="0",
      metavar="N", help="Worker-group restarts allowed after failures before the job fails.")
@_opt("--monitor-interval", "--monitor_interval", "monitor_interval", group=_WORKERS, type=P.PARSED,
      default="0.1", metavar="SECONDS",
      help="Seconds between the agent's checks of the rendezvous, progress (--hang-timeout) and stuck workers "
           "(> 0); a worker's exit is seen at once.")
@_opt("--start-method", "--start_method", "start_method", group=_WORKERS, type=P.PARSED, default="spawn",
      metavar="spawn|fork|forkserver", help="Accepted for compatibility; workers are always exec'd processes.")
@_opt("--role", "role", group=_WORKERS, default="default", metavar="NAME", help="Role of the workers (ROLE_NAME).")
@_flag("-m", "--module", "module", group=_WORKERS, help="Run the script as a module, like 'python -m'.")
@_flag("--no-python", "--no_python", "no_python", group=_WORKERS,
       help="Run the script directly, not with python (any executable, found on PATH).")
@_flag("--run-path", "--run_path", "run_path", group=_WORKERS,
       help="Run the script with runpy.run_path in each worker; takes precedence over --no-python.")
@_flag("--warm-start", "--warm_start", "warm_start", group=_WORKERS,
       help="Keep a spare interpreter per worker with --warm-start-modules imported, so restarted "
            "workers skip those imports (elaunch only; not with --no-python).")
@_opt("--warm-start-modules", "--warm_start_modules", "warm_start_modules", group=_WORKERS, type=P.PARSED,
      default="torch", metavar="MOD,...", help="Modules each warm spare imports in advance.")
@_opt("--shutdown-timeout", "--shutdown_timeout", "shutdown_timeout", group=_WORKERS, type=P.PARSED,
      default=None, metavar="SECONDS",
      help="Seconds between SIGTERM and SIGKILL when stopping workers "
           "[default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30].")
@_opt("--signals-to-handle", "--signals_to_handle", "signals_to_handle", group=_WORKERS, type=P.PARSED,
      default=",".join(DEFAULT_SIGNALS), metavar="SIG,...",
      help="Signals the agent catches and forwards to the workers before stopping them.")
@_opt("--forward-signals", "--forward_signals", "forward_signals", group=_WORKERS, type=P.PARSED,
      default=",".join(DEFAULT_FORWARD_SIGNALS), metavar="SIG,...|none",
      help="Signals the agent forwards to every worker's process group while it keeps running: a "
           "notice such as Slurm's preemption warning, not a stop. '' or none forwards none; the "
           "default leaves out any signal named by --signals-to-handle (elaunch only).")
@_opt("--hang-timeout", "--hang_timeout", "hang_timeout", group=_WORKERS, type=P.PARSED, default="0",
      metavar="SECONDS",
      help="A worker that called elaunch.progress() at least once and then not for SECONDS is hung: "
           "its stacks are dumped and it counts as that rank's failure. 0 turns this off (elaunch only).")
@_flag("--virtual-local-rank", "--virtual_local_rank", "virtual_local_rank", group=_WORKERS,
       help="Give every worker LOCAL_RANK=0 and restrict CUDA_VISIBLE_DEVICES to its own GPU.")
@_opt("--numa-binding", "--numa_binding", "numa_binding", group=_WORKERS, type=P.PARSED, default=None,
      metavar="node|socket|exclusive|core-complex", help="Bind workers to CPUs near their GPU.")
@_opt("--log-dir", "--log_dir", "log_dir", group=_LOGS, default=None, metavar="DIR",
      help="Base directory for worker logs (a run-specific subdirectory is created).")
@_opt("-r", "--redirects", "redirects", group=_LOGS, type=P.PARSED, default="0", metavar="0-3|R:0-3,...",
      help="Redirect worker streams to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
           "rank, e.g. 0:1,1:2.")
@_opt("-t", "--tee", "tee", group=_LOGS, type=P.PARSED, default="0", metavar="0-3|R:0-3,...",
      help="Like --redirects, but also keep the streams on the console.")
@_opt("--local-ranks-filter", "--local_ranks_filter", "local_ranks_filter", group=_LOGS, type=P.PARSED,
      default="", metavar="R,R,...", help="Show only these local ranks' output on the console [default: all].")
@_opt("--duplicate-stdout-filters", "--duplicate_stdout_filters", "duplicate_stdout_filters", group=_LOGS,
      type=P.PARSED, default="", metavar="A,B,...",
      help="Copy stdout lines containing any of these strings to a separate file (',,' escapes a comma).")
@_opt("--duplicate-stderr-filters", "--duplicate_stderr_filters", "duplicate_stderr_filters", group=_LOGS,
      type=P.PARSED, default="", metavar="A,B,...", help="Same as --duplicate-stdout-filters, for stderr.")
@_opt("--event-log-handler", "--event_log_handler", "event_log_handler", group=_LOGS, default="null",
      metavar="NAME", help="torch.distributed.elastic event handler name.")
@_opt("--logs-specs", "--logs_specs", "logs_specs", group=_LOGS, default=None, metavar="NAME",
      help="Name of a 'torchrun.logs_specs' entry point customising log files.")
@_opt("--node-rank", "--node_rank", "node_rank", group=_STATIC, type=P.PARSED, default="0", metavar="N",
      help="Rank of this node (static rendezvous only), 0 .. nnodes-1.")
@_opt("--master-addr", "--master_addr", "master_addr", group=_STATIC, default="127.0.0.1", metavar="HOST",
      help="Address of the rank-0 node (static rendezvous without --rdzv-endpoint).")
@_opt("--master-port", "--master_port", "master_port", group=_STATIC, type=P.PARSED, default=None,
      metavar="PORT", help="Port on the rank-0 node (static rendezvous) [default: 29500].")
@_opt("--local-addr", "--local_addr", "local_addr", group=_STATIC, default=None, metavar="HOST",
      help="This node's address as the others reach it [default: its FQDN].")
@click.argument("training_script", required=False, metavar="SCRIPT")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
def main(**options: Any) -> LaunchConfig:
    """Launch SCRIPT on this node as a group of workers: a drop-in replacement for torchrun.

    SCRIPT (a Python file, a module with -m, or a program with --no-python) and
    everything after it are passed to each worker untouched.
    """
    ctx = click.get_current_context()
    if ctx.get_parameter_source("forward_signals") is ParameterSource.DEFAULT:
        options["forward_signals"] = None  # the default yields to --signals-to-handle
    environ = ctx.find_root().obj
    return build_config(LaunchOptions(**options), environ if isinstance(environ, Mapping) else os.environ)


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
