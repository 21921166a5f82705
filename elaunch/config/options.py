"""The option table: one row per option of ``elaunch`` (torchrun's flags plus elaunch's own), and LaunchOptions.

Every fact about an option lives in its :class:`Option` row of :data:`OPTIONS`:
its spellings, ``PET_*`` variable, parser, default and unit, help, ``--help``
group, argparse type and torch ``LaunchConfig`` field. Derived from it: the click
command (``elaunch.cli``), ``elaunch.run``'s argparse parser, :class:`LaunchOptions`
(the typed, checked options of one launch), the defaults of
``elaunch.config.LaunchConfig`` and of ``elaunch.launcher.LaunchConfig``'s shared
fields, and docs/cli.md's reference (``python -m elaunch.cli.reference``).
Stdlib only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass
from functools import partial
from collections.abc import Mapping
from typing import Any, Callable

from elaunch.config import values as V
from elaunch.config.errors import ConfigError
from elaunch.rendezvous.registry import user_backend_names

__all__ = ["DEFAULT_FORWARD_SIGNALS", "DEFAULT_INPROCESS_TIMEOUT", "DEFAULT_MASTER_PORT", "DEFAULT_PERSIST_INTERVAL",
           "DEFAULT_SHUTDOWN_TIMEOUT", "DEFAULT_SIGNALS", "DEFAULT_WARM_MODULES", "GROUPS", "NUMA_MODES", "OPTIONS",
           "START_METHODS", "LaunchOptions", "Option", "default_of", "parse_replicas", "replicas_for"]

#: Seconds between SIGTERM and SIGKILL when neither the flag nor ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: ``--inprocess-timeout`` default, seconds. A survivor is ready well under a second after the abort (its
#: collectives end when the dead peer's sockets close or NCCL is aborted); one that is not within this
#: is stuck (an NCCL abort that did not return, a call no signal ends) and costs its rank a new process,
#: what the full restart costs anyway, instead of --shutdown-timeout's 30 s first.
DEFAULT_INPROCESS_TIMEOUT = 10.0
#: torch's variable for the seconds between SIGTERM and SIGKILL (its ``LaunchConfig.shutdown_timeout`` default).
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: ``--master-port`` default for the static rendezvous, as torchrun.
DEFAULT_MASTER_PORT = 29500
#: ``--start-method`` values (kept for parity: elaunch's exec'd workers ignore it).
START_METHODS = ("spawn", "fork", "forkserver")
#: ``--numa-binding`` modes.
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
#: ``--signals-to-handle`` default, as torchrun.
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: ``--warm-start-modules`` default: ``torch._dynamo`` because the first ``torch.optim`` optimizer imports it
#: (about 1 s of CPU), so nearly every training script does.
DEFAULT_WARM_MODULES = ("torch", "torch._dynamo")
#: ``--forward-signals`` default, minus any signal handled: notices (Slurm's ``--signal=B:USR1@120``), not stops.
DEFAULT_FORWARD_SIGNALS = ("SIGUSR1", "SIGUSR2")

NODES, RDZV, WORKERS, CKPT, LOGS, STATIC = (
    "Nodes and workers",
    "Rendezvous",
    "Worker launch",
    "In-memory checkpoints (elaunch.checkpoint)",
    "Logging and output",
    "Static rendezvous (torch.distributed.launch compatibility)",
)
#: The sections of ``elaunch --help`` and docs/cli.md, in order.
GROUPS = (NODES, RDZV, WORKERS, CKPT, LOGS, STATIC, "Other")
#: ``--checkpoint-persist-interval`` default, seconds: a background ``torch.save`` + fsync of a 256 MiB
#: snapshot takes about 0.7 s of one core, so once a minute costs about 1 % of a core; failures of a
#: worker or a node are covered by memory and peer replicas, and the agent also persists when a worker
#: dies, on a notice and on SIGTERM: the interval only bounds what a loss of every node at once costs.
DEFAULT_PERSIST_INTERVAL = 60.0


def comma_list(text: str) -> list[str]:
    """torchrun's argparse type of a comma-separated option (``,,`` escapes a comma)."""
    return list(V.parse_comma_list(text))


@dataclass(frozen=True)
class Option:
    """One option of the command, everything known about it.

    Attributes:
        dest: torchrun's argparse ``dest``: the spellings are ``--dash-form``, the
            ``--under_score`` form when it differs and ``short``; the environment
            fallback is ``PET_<DEST>``.
        group: its section of ``--help``.
        help: its help text.
        default: as typed on the command line (text; argparse's and click's default),
            False for a flag, None for none (or one ``build_config`` resolves).
        metavar: the value's placeholder in ``--help``; "" for a flag.
        parse: ``(text or typed value, label) -> typed value``, raising ConfigError
            naming ``label``; None keeps the text.
        unit: the default's unit ("seconds" for a duration), "" for none.
        short: the one-letter spelling (``-m``), or "".
        shown: the default ``--help`` shows when ``default`` is None because
            ``build_config`` resolves it from other options.
        argtype: torchrun's argparse ``type`` (str, int, float or :func:`comma_list`).
        choices: the values argparse accepts, or None for any.
        torch: the field of torch's ``launcher.api.LaunchConfig`` it sets, or None.
        elaunch_only: elaunch's own (no torchrun abbreviation expands to it).
        env_fallback: a torch environment variable giving the value when neither the flag nor
            its ``PET_*`` variable does (``default`` is then None), or None; see :meth:`from_environ`.
        fallback: the typed value when ``env_fallback`` is unset or empty.
    """

    dest: str
    group: str
    help: str
    default: Any = None
    metavar: str = ""
    parse: Callable[[Any, str], Any] | None = None
    unit: str = ""
    short: str = ""
    shown: str | None = None
    argtype: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    torch: str | None = None
    elaunch_only: bool = False
    env_fallback: str | None = None
    fallback: Any = None

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling: ``("-r", "--redirects")``, ``("--nproc-per-node", "--nproc_per_node")``."""
        under = "--" + self.dest
        return tuple(s for s in (self.short, self.long, under if under != self.long else "") if s)

    @property
    def long(self) -> str:
        """The dash spelling, which errors name: ``--nproc-per-node``."""
        return "--" + self.dest.replace("_", "-")

    @property
    def envvar(self) -> str:
        """The ``PET_*`` variable the option falls back to."""
        return "PET_" + self.dest.upper()

    @property
    def is_flag(self) -> bool:
        """True for an option that takes no value."""
        return self.default is False

    def value(self) -> Any:
        """The typed default (a fresh object each call): ``"1:1"`` -> ``(1, 1)``."""
        if self.parse is None or self.default is None:
            return self.default
        return self.parse(self.default, self.long)

    def from_environ(self, environ: Mapping[str, str]) -> Any:
        """The value of the option when it was not given: ``$env_fallback`` in ``environ``, parsed
        by ``parse`` (its errors name the variable), or ``fallback`` when the variable is unset or empty.

        Raises:
            ConfigError: the variable's value is one ``parse`` rejects (e.g.
                ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon: expected seconds (a number)``).
        """
        raw = environ.get(self.env_fallback) if self.env_fallback else None
        if raw is None or raw.strip() == "":
            return self.fallback
        return self.parse(raw, self.env_fallback)


def parse_replicas(text: Any, label: str = "--checkpoint-replicas") -> int | str:
    """``--checkpoint-replicas``: ``auto`` (kept as text; see :func:`replicas_for`) or an integer >= 0.

    Raises:
        ConfigError: anything else.
    """
    if str(text).strip() == "auto":
        return "auto"
    try:
        return V.parse_int(text, label, minimum=0)
    except ConfigError:
        raise ConfigError(f"{label}={text}: expected auto or an integer >= 0") from None


def replicas_for(value: int | str | None, max_nodes: int) -> int:
    """The number of peer copies of each snapshot: ``value``, or for ``auto`` (or None) 1 when the job
    can have more than one node (``max_nodes`` > 1), else 0 (off)."""
    if value is None or value == "auto":
        return 1 if max_nodes > 1 else 0
    return int(value)


def _seconds(allow_zero: bool) -> Callable[[Any, str], Any]:
    return partial(V.parse_seconds, allow_zero=allow_zero)


_ROWS = (
    Option("nnodes", NODES, "Number of nodes, or the range MIN:MAX for an elastic job.", "1:1", "N|MIN:MAX",
           V.parse_nnodes, torch="min_nodes, max_nodes"),
    Option("nproc_per_node", NODES, "Workers per node: an integer, or cpu (usable CPUs), gpu (CUDA devices), xpu, "
           "auto (accelerators if any, else CPUs).", "1", "N|auto|cpu|gpu|xpu", V.parse_nproc, torch="nproc_per_node"),
    Option("rdzv_backend", RDZV, f"Rendezvous backend: {', '.join(user_backend_names())}, or a name registered in "
           "the 'torchrun.handlers' entry-point group.", "static", "BACKEND", V.parse_backend, torch="rdzv_backend"),
    Option("rdzv_endpoint", RDZV, "Rendezvous endpoint, host[:port] ([::1]:29400 for IPv6; etcd: a comma-separated "
           "list).", "", "HOST[:PORT]", torch="rdzv_endpoint"),
    Option("rdzv_id", RDZV, "Job id shared by all nodes of the job (TORCHELASTIC_RUN_ID).", "none", "ID",
           torch="run_id"),
    Option("rdzv_conf", RDZV, "Backend options, e.g. join_timeout=600,last_call_timeout=30 (timeouts in seconds).",
           "", "K=V,...", V.parse_kv_list, torch="rdzv_configs"),
    Option("standalone", RDZV, "Single-node job with a local rendezvous on a free port; any rendezvous backend, "
           "endpoint and id flags are ignored.", False),
    Option("max_restarts", WORKERS, "Worker-group restarts allowed after failures before the job fails.", "0", "N",
           partial(V.parse_int, minimum=0), argtype=int, torch="max_restarts"),
    Option("monitor_interval", WORKERS, "Seconds between the agent's checks of the rendezvous, progress "
           "(--hang-timeout) and stuck workers (> 0); a worker's exit is seen at once.", "0.1", "SECONDS",
           _seconds(False), "seconds", argtype=float, torch="monitor_interval"),
    Option("start_method", WORKERS, "Accepted for compatibility; workers are always exec'd processes.", "spawn",
           "|".join(START_METHODS), partial(V.parse_choice, choices=START_METHODS, what="start method"),
           choices=START_METHODS, torch="start_method"),
    Option("role", WORKERS, "Role of the workers (ROLE_NAME).", "default", "NAME", torch="role"),
    Option("module", WORKERS, "Run the script as a module, like 'python -m'.", False, short="-m"),
    Option("no_python", WORKERS, "Run the script directly, not with python (any executable, found on PATH).", False),
    Option("run_path", WORKERS, "Run the script with runpy.run_path in each worker; takes precedence over "
           "--no-python.", False),
    Option("warm_start", WORKERS, "Keep a spare interpreter per worker with --warm-start-modules imported (forked "
           "from one template per node), so workers skip those imports (elaunch only; not with --no-python).", False,
           elaunch_only=True),
    Option("warm_start_modules", WORKERS, "Modules the node's warm template imports in advance, once, for every "
           "spare (torch._dynamo: the first torch.optim optimizer imports it).", ",".join(DEFAULT_WARM_MODULES),
           "MOD,...",
           V.parse_comma_list, argtype=comma_list, elaunch_only=True),
    Option("shutdown_timeout", WORKERS, "Seconds between SIGTERM and SIGKILL when stopping workers [default: "
           f"${SHUTDOWN_TIMEOUT_ENV} or {DEFAULT_SHUTDOWN_TIMEOUT:g}].", None, "SECONDS", _seconds(True),
           "seconds", argtype=float, torch="shutdown_timeout", env_fallback=SHUTDOWN_TIMEOUT_ENV,
           fallback=DEFAULT_SHUTDOWN_TIMEOUT),
    Option("inprocess_timeout", WORKERS, "Seconds a survivor of an in-process restart (elaunch.restartable) has "
           "to stop its round and say ready after the abort; one that has not is killed, its stacks written first, "
           "and its rank replaced like a dead worker's (elaunch only).", f"{DEFAULT_INPROCESS_TIMEOUT:g}", "SECONDS",
           _seconds(False), "seconds", argtype=float, elaunch_only=True),
    Option("signals_to_handle", WORKERS, "Signals the agent catches and forwards to the workers before stopping "
           "them.", ",".join(DEFAULT_SIGNALS), "SIG,...", V.parse_signals, torch="signals_to_handle"),
    Option("forward_signals", WORKERS, "Signals the agent forwards to every worker's process group while it keeps "
           "running: a notice such as Slurm's preemption warning, not a stop. '' or none forwards none; the default "
           "leaves out any signal named by --signals-to-handle (elaunch only).", None, "SIG,...|none",
           partial(V.parse_signals, allow_empty=True), shown=",".join(DEFAULT_FORWARD_SIGNALS), elaunch_only=True),
    Option("hang_timeout", WORKERS, "A worker that called elaunch.progress() at least once and then not for SECONDS "
           "is hung: its stacks are dumped and it counts as that rank's failure. 0 turns this off (elaunch only).",
           "0", "SECONDS", _seconds(True), "seconds", argtype=float, elaunch_only=True),
    Option("node_check", WORKERS, "After each round forms and before the workers start, time a compute probe on "
           "every node and an all-reduce between pairs of nodes (docs/node-check.md); a node slower than "
           "node_check_slow_factor (an --rdzv-conf key, default 2) x the median, or whose check fails, is named, and "
           "sits out when the --rdzv-conf key exclude_after is given (c10d and etcd; elaunch only).", False,
           elaunch_only=True),
    Option("virtual_local_rank", WORKERS, "Give every worker LOCAL_RANK=0 and restrict CUDA_VISIBLE_DEVICES to its "
           "own GPU.", False, torch="virtual_local_rank"),
    Option("numa_binding", WORKERS, "Bind workers to CPUs near their GPU.", None, "|".join(NUMA_MODES),
           partial(V.parse_choice, choices=NUMA_MODES, what="NUMA binding mode"), choices=NUMA_MODES,
           torch="numa_options"),
    Option("checkpoint_replicas", CKPT, "Peer nodes that keep a copy of each node's newest in-memory "
           "snapshots (ckpt.save), sent in the background; auto: 1 when the job can have more than one node, "
           "else 0; 0 is off (elaunch only).", "auto", "N|auto", parse_replicas, elaunch_only=True),
    Option("checkpoint_dir", CKPT, "Directory the agent persists the newest in-memory snapshot to (torch.load "
           "reads it): every --checkpoint-persist-interval, when a worker dies, on a forwarded notice and on "
           "SIGTERM [default: none, nothing is persisted] (elaunch only).", None, "DIR", elaunch_only=True),
    Option("checkpoint_persist_interval", CKPT, "Seconds between background persists to --checkpoint-dir; 0: "
           "only when a worker dies, on a notice and on SIGTERM (elaunch only).", f"{DEFAULT_PERSIST_INTERVAL:g}",
           "SECONDS", _seconds(True), "seconds", argtype=float, elaunch_only=True),
    Option("checkpoint_timeout", CKPT, "Seconds the agent waits at a round's start for each snapshot fetched from a "
           "peer, and on SIGTERM for the last persist to --checkpoint-dir (elaunch only).", "30", "SECONDS",
           _seconds(False), "seconds", argtype=float, elaunch_only=True),
    Option("checkpoint_exchange_timeout", CKPT, "Seconds the agent waits at a round's start for the other nodes' "
           "lists of the snapshots they hold (the wait ends as soon as all are in; a node missing then counts as "
           "holding none, alike on every node) (elaunch only).", "5", "SECONDS", _seconds(False), "seconds",
           argtype=float, elaunch_only=True),
    Option("log_dir", LOGS, "Base directory for worker logs (a run-specific subdirectory is created).", None, "DIR",
           torch="logs_specs"),
    Option("redirects", LOGS, "Redirect worker streams to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per "
           "local rank, e.g. 0:1,1:2.", "0", "0-3|R:0-3,...", V.parse_std, short="-r", torch="logs_specs"),
    Option("tee", LOGS, "Like --redirects, but also keep the streams on the console.", "0", "0-3|R:0-3,...",
           V.parse_std, short="-t", torch="logs_specs"),
    Option("local_ranks_filter", LOGS, "Show only these local ranks' output on the console [default: all].", "",
           "R,R,...", V.parse_rank_set, torch="logs_specs"),
    Option("duplicate_stdout_filters", LOGS, "Copy stdout lines containing any of these strings to a separate file "
           "(',,' escapes a comma).", "", "A,B,...", V.parse_comma_list, argtype=comma_list,
           torch="duplicate_stdout_filters"),
    Option("duplicate_stderr_filters", LOGS, "Same as --duplicate-stdout-filters, for stderr.", "", "A,B,...",
           V.parse_comma_list, argtype=comma_list, torch="duplicate_stderr_filters"),
    Option("metrics_port", LOGS, "Serve this agent's Prometheus metrics (docs/metrics.md) at "
           "http://ADDR:PORT/metrics, ADDR being --local-addr or every interface; 0 picks a free port, which the "
           "agent logs [default: none, no metrics server] (elaunch only).", None, "PORT",
           partial(V.parse_int, minimum=0, maximum=65535), argtype=int, elaunch_only=True),
    Option("event_log_handler", LOGS, "torch.distributed.elastic event handler name.", "null", "NAME",
           torch="event_log_handler"),
    Option("logs_specs", LOGS, "Name of a 'torchrun.logs_specs' entry point customising log files.", None, "NAME",
           torch="logs_specs"),
    Option("node_rank", STATIC, "Rank of this node (static rendezvous only), 0 .. nnodes-1.", "0", "N",
           partial(V.parse_int, minimum=0), argtype=int, torch="rdzv_configs"),
    Option("master_addr", STATIC, "Address of the rank-0 node (static rendezvous without --rdzv-endpoint).",
           "127.0.0.1", "HOST", V.parse_host, torch="rdzv_endpoint"),
    Option("master_port", STATIC, f"Port on the rank-0 node (static rendezvous) [default: {DEFAULT_MASTER_PORT}].",
           None, "PORT", partial(V.parse_int, minimum=1, maximum=65535), argtype=int, torch="rdzv_endpoint"),
    Option("local_addr", STATIC, "This node's address as the others reach it [default: its FQDN].", None, "HOST",
           V.parse_host, torch="local_addr"),
)
#: The rows by ``dest``, in ``--help`` order.
OPTIONS: dict[str, Option] = {o.dest: o for o in _ROWS}


def default_of(dest: str) -> Any:
    """The typed default of option ``dest`` (``default_of("hang_timeout")`` is 0.0)."""
    return OPTIONS[dest].value()


class _Checked:
    """torchrun's options by their argparse ``dest`` names (:data:`OPTIONS`), typed and checked.

    ``training_script`` (None is rejected by ``build_config``) and its
    ``training_script_args``, then one attribute per row of :data:`OPTIONS`. A
    value of None takes the row's typed default (:meth:`Option.value`; None for an
    option resolved later: from its row's ``env_fallback`` or other options by
    ``build_config`` (``shutdown_timeout``, ``master_port``), or by the ``LaunchConfig``
    (``forward_signals``)); so does ``""`` for a free-text option (``rdzv_id``,
    ``role``, ``master_addr``, ``log_dir``, ...), as an empty ``PET_*`` variable
    counts as unset. Text forms are parsed by the row's parser (``nnodes="1:4"``
    gives ``(1, 4)``, ``rdzv_conf="a=1"`` a dict), typed values checked, so an
    options object is valid whoever built it (the CLI, ``elaunch.run``, a test);
    ``build_config`` then checks only what spans several options.

    Raises (on construction):
        ConfigError: a value its row's parser rejects; the message names the flag.
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "training_script", self.training_script or None)
        object.__setattr__(self, "training_script_args", tuple(self.training_script_args or ()))
        for o in _ROWS:
            value = getattr(self, o.dest)
            if value is None or (value == "" and o.parse is None):
                value = o.value()
            elif o.parse is not None:
                value = o.parse(value, o.long)
            elif o.is_flag:
                value = bool(value)
            object.__setattr__(self, o.dest, value)

    @classmethod
    def from_namespace(cls, args: Any) -> Any:
        """Return the options an ``argparse.Namespace`` (or any object) carries as attributes.

        Mirrors what ``torch.distributed.run.config_from_args`` reads from its ``args``:
        attributes named as torchrun's ``dest``; a missing one takes the default,
        others (``use_env``, ...) are ignored.

        Raises:
            ConfigError: a value its row's parser rejects.
        """
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


LaunchOptions = make_dataclass(
    "LaunchOptions",
    [("training_script", "str | None", None), ("training_script_args", "tuple[str, ...]", ()),
     *((o.dest, "Any", None) for o in _ROWS)],
    bases=(_Checked,), frozen=True)
LaunchOptions.__module__, LaunchOptions.__doc__ = __name__, _Checked.__doc__
