"""The launcher's vocabulary: WorkerSpec, Worker, WorkerGroup, WorkerState, RunResult.

This module must not depend on any non-stdlib module (nor on torch): the CLI,
the agent and the process supervisor all share it, and ``import elaunch.agent``
must stay light.

The names mirror ``torch.distributed.elastic.agent.server.api``; the shapes are
simplified where torch carries fields that only its own plumbing needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

#: Placeholder substituted in worker arguments with the worker's local rank,
#: the same macro torchrun substitutes (``torch.distributed.elastic.utils.macros``).
LOCAL_RANK_MACRO = "${local_rank}"



def signal_name(exitcode: int) -> str:
    """``"SIGKILL"`` for exit code -9 (a death by signal ``-exitcode``); ``"signal 99"`` for one Python cannot name.

    The one formatter of a signal's name: failure summaries, log lines, events and helpers use it.
    """
    import signal

    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"

class WorkerState(str, enum.Enum):
    """State of a WorkerGroup, as torch's ``WorkerState``.

    INIT: created, not started. HEALTHY: all workers running. UNHEALTHY: running
    but reported unwell (unused by the local agent, kept for parity). STOPPED:
    stopped by the agent (membership change, signal). SUCCEEDED: every worker
    exited 0. FAILED: at least one worker exited non-zero or was killed.
    UNKNOWN: the agent could not tell (an error in the agent itself).
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


#: States in which worker processes exist and must be watched.
RUNNING_STATES = frozenset({WorkerState.HEALTHY, WorkerState.UNHEALTHY})
#: States after which the agent loop ends (no restart follows).
TERMINAL_STATES = frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNKNOWN})


@dataclass(frozen=True)
class WorkerSpec:
    """What to run on this node: the same for every round.

    Mirrors ``torch.distributed.elastic.agent.server.WorkerSpec``; the
    rendezvous handler is given to the agent separately rather than carried here,
    and so are the agent's options (``--max-restarts``, ``--monitor-interval``: the
    launch's ``LaunchConfig``), so that each is held in one place.

    Attributes:
        role: role name of the workers (``--role``), ``ROLE_NAME`` in their env.
        local_world_size: number of workers on this node (``--nproc-per-node``), >= 1.
        cmd: argv of one worker, e.g. ``("/usr/bin/python3", "-u", "train.py", "--lr=1")``.
            Occurrences of ``${local_rank}`` are replaced per worker.
        local_addr: this node's address as other nodes reach it, or None for the FQDN.
    """

    role: str
    local_world_size: int
    cmd: tuple[str, ...]
    local_addr: str | None = None

    def worker_cmd(self, local_rank: int) -> list[str]:
        """Return the argv of the worker with ``local_rank``, macros substituted."""
        return [a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in self.cmd]


@dataclass
class Worker:
    """One worker process of a group: its ranks and, once started, its pid.

    Attributes:
        local_rank: index on this node, 0 .. local_world_size-1 (``LOCAL_RANK``).
        global_rank: rank in the whole job (``RANK``).
        role_rank: rank among workers of the same role (``ROLE_RANK``).
        world_size: workers in the whole job (``WORLD_SIZE``).
        role_world_size: workers of this role in the job (``ROLE_WORLD_SIZE``).
        pid: process id once started, else None.
    """

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    pid: int | None = None


@dataclass
class WorkerGroup:
    """The workers of one node for one rendezvous round.

    Attributes:
        spec: the WorkerSpec they run.
        workers: one Worker per local rank, in local-rank order.
        state: the group's WorkerState.
        round: the rendezvous round the group belongs to (>= 0).
        group_rank: this node's rank among the nodes (``GROUP_RANK``).
        group_world_size: number of nodes in the round (``GROUP_WORLD_SIZE``).
        master_addr, master_port: the workers' store (``MASTER_ADDR``/``MASTER_PORT``).
    """

    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    state: WorkerState = WorkerState.INIT
    round: int = -1
    group_rank: int = -1
    group_world_size: int = -1
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class ProcessFailure:
    """How one worker failed.

    Attributes:
        local_rank, global_rank: the worker's ranks (global_rank -1 if unknown).
        pid: its process id.
        exitcode: its exit status; negative for death by signal (``-signum``), as
            ``subprocess`` and torch report it.
        timestamp: when the agent saw the exit, seconds since the epoch (float).
        hostname: this node's name, for the summary.
        error_file: path of its TORCHELASTIC_ERROR_FILE.
        error_data: the parsed error file (torch's JSON shape) or None if it wrote none.
        stderr_tail: the last lines of its stderr log, when redirected, else "".
        error_time: when the error file was written (its mtime, seconds since the
            epoch, sub-second precision), or None. The file's own timestamp has
            whole seconds only, too coarse to order two ranks failing together.
        remote: True when another node's agent reported this failure through the
            rendezvous (the job's root cause, seen from a node that did not fail).
        detail: text shown as the traceback when there is no error file: a remote
            failure's message, or a hung worker's stacks.
    """

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    timestamp: float
    hostname: str = ""
    error_file: str = ""
    error_data: dict | None = None
    stderr_tail: str = ""
    error_time: float | None = None
    remote: bool = False
    detail: str = ""

    @property
    def signal_name(self) -> str:
        """Name of the killing signal (``"SIGKILL"``) or ``""`` for a normal exit."""
        return signal_name(self.exitcode) if self.exitcode < 0 else ""


@dataclass
class RunResult:
    """Outcome of ``ElasticAgent.run()``.

    Attributes:
        state: SUCCEEDED or FAILED (UNKNOWN if the agent itself broke).
        failures: the failed workers of the last round, keyed by global rank.
        restarts: failed-group restarts used (the job's, where the rendezvous counts them).
        root_rank: global rank of the job's root cause when it is known from the
            rendezvous (possibly another node's worker), else None: the earliest of
            ``failures``.
        global_ranks: after success, local rank -> global rank of this node's workers
            in the final round (the keys of torch's ``RunResult.return_values``);
            empty when this node ran no workers at the end.
    """

    state: WorkerState
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    restarts: int = 0
    root_rank: int | None = None
    global_ranks: dict[int, int] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state is not WorkerState.SUCCEEDED
