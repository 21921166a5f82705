"""Starting this node's WorkerGroup of a round: its ranks, master address and workers' commands.

Mirrors torch's ``LocalElasticAgent._start_workers``: the ranks come from
:func:`~elaunch.agent.ranks.assign_ranks` (torch's ``_assign_worker_ranks``), each
worker's variables from :func:`~elaunch.agent.env.worker_env`, and the processes
are started by ``procs.WorkerLauncher.start``. With ``--warm-start`` the first
attempt's spares are made here too, before the first round (torchrun has no spares).
The agent (``agent.py``) decides when a group starts and announces it once started.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from collections.abc import Mapping, Sequence

from elaunch.agent.env import EnvOptions, worker_env
from elaunch.agent.ranks import assign_ranks
from elaunch.agent.watchdog import Watchdog
from elaunch.procs import AttemptLogs, WorkerLauncher, WorkerProcesses, line_prefix
from elaunch.rendezvous.contract import RendezvousInfo
from elaunch.spec import Worker, WorkerGroup, WorkerSpec

log = logging.getLogger("elaunch.agent")


class GroupStarter:
    """Makes this node's WorkerGroup of each round and starts its workers through the launcher.

    Args:
        spec: what to run.
        launcher: the run's worker launcher, opened.
        env_opts: the per-job worker environment inputs (``use_agent_store`` is each round's).
        base_env: the environment every worker inherits.
        line_prefix_template: the console prefix of tee'd lines
            (``LogsSpec.line_prefix_template``, torchrun's ``--log-line-prefix-template``), or None.
        watchdogs: the run's watchdogs: each adds its variables to every worker's
            environment and learns of each new attempt before its workers start.
    """

    def __init__(self, spec: WorkerSpec, launcher: WorkerLauncher, env_opts: EnvOptions,
                 base_env: Mapping[str, str], line_prefix_template: str | None,
                 watchdogs: Sequence[Watchdog]) -> None:
        self._spec = spec
        self._launcher = launcher
        self._env_opts = env_opts
        self._base_env = base_env
        self._prefix_template = line_prefix_template
        self._watchdogs = watchdogs
        self._last: tuple[dict[int, list[str]], dict[int, dict[str, str]]] = ({}, {})  # the running attempt's

    def group(self, info: RendezvousInfo) -> WorkerGroup:
        """This node's WorkerGroup of the round ``info``: ranks assigned, INIT, no pids yet.

        As torchrun's agent, when the round says so (``info.host_store``) every worker is a
        client of a store this agent hosts at ``info.master_addr`` (on ``info.master_port``;
        0: a free port, the one bound is the group's).

        Raises:
            ValueError: the round's node list disagrees with this node (see ``assign_ranks``).
            OSError: the store cannot be served.
        """
        spec = self._spec
        workers = assign_ranks(info.nodes, info.rank, info.world_size, spec.role, spec.local_world_size)
        master_addr, master_port = info.master_addr, info.master_port
        if info.host_store:
            master_port = self._launcher.serve_store(master_addr, master_port)
        return WorkerGroup(spec=spec, workers=workers, round=info.round, group_rank=info.rank,
                           group_world_size=info.world_size, master_addr=master_addr, master_port=master_port)

    def start(self, group: WorkerGroup, attempt: int, logs: AttemptLogs, restarts: int, use_agent_store: bool,
              another_may_follow: bool, keep=None) -> WorkerProcesses:
        """Start ``group``'s workers as attempt ``attempt``; fill in their pids; log the ranks started.

        Args:
            group: from :meth:`group`.
            attempt: the attempt number (>= 0) that ``logs`` were made for.
            logs: the attempt's destinations (``WorkerLauncher.attempt_logs``).
            restarts: the job's counted restarts so far (``TORCHELASTIC_RESTART_COUNT``).
            use_agent_store: the round's ``TORCHELASTIC_USE_AGENT_STORE``.
            another_may_follow: an attempt may follow this one (the warm pool then
                prepares its spares while this one runs).
            keep: the processes that keep their local rank (``WorkerLauncher.start``'s
                ``keep``: in-process restart's survivors), or None.

        Raises:
            OSError: a worker could not be started (those already started are killed).
            ValueError: ``--virtual-local-rank`` and a local rank without a device (as torchrun).
        """
        opts = self._env_opts
        if opts.use_agent_store != use_agent_store:
            opts = dataclasses.replace(opts, use_agent_store=use_agent_store)
        cmds, envs = self._commands(group, restarts, logs.error_file, opts)
        self._last = cmds, envs
        prefixes = {w.local_rank: line_prefix(self._prefix_template, self._spec.role, w.global_rank, w.local_rank)
                    for w in group.workers}
        for watchdog in self._watchdogs:
            watchdog.new_attempt(group.round)
        procs = self._launcher.start(attempt, logs, cmds, envs, prefixes, another_may_follow=another_may_follow,
                                     keep=keep)
        workers = group.workers
        for w in workers:
            w.pid = procs.pids[w.local_rank]
        log.info("round %d: node %d/%d started ranks %d-%d of %d (master %s:%s)", group.round, group.group_rank,
                 group.group_world_size, workers[0].global_rank, workers[-1].global_rank, workers[0].world_size,
                 group.master_addr, group.master_port)
        return procs

    def prestart(self, local_rank: int, extra_env: dict[str, str]) -> "subprocess.Popen | None":
        """Hand ``local_rank``'s next warm spare the running attempt's worker of that rank now
        (``WorkerLauncher.prestart``: in-process restart's replacement of a dead worker, which the
        next attempt adopts); its process, or None when none was started."""
        cmds, envs = self._last
        if local_rank not in cmds:
            return None
        return self._launcher.prestart(local_rank, cmds[local_rank], envs[local_rank], extra_env)

    def prewarm(self, restarts: int) -> None:
        """With ``--warm-start``, start the first attempt's spares now, before the first round.

        Their imports then overlap the rendezvous (and, for a node that replaces a lost
        one, the others' wait for it) instead of following it. Only the variables a round
        sets (``warm.ROUND_KEYS``) are unknown yet; they are handed over with the worker.
        Without ``--warm-start`` nothing starts.
        """
        workers = [Worker(local_rank=lr) for lr in range(self._spec.local_world_size)]
        group = WorkerGroup(spec=self._spec, workers=workers)
        cmds, envs = self._commands(group, restarts, {}, self._env_opts)
        self._launcher.prewarm(0, cmds, envs)

    def _commands(self, group: WorkerGroup, restarts: int, error_files: Mapping[int, str],
                  opts: EnvOptions) -> tuple[dict[int, list[str]], dict[int, dict[str, str]]]:
        """Each local rank's argv and full environment (torchrun's variables, the watchdogs')."""
        cmds, envs = {}, {}
        for w in group.workers:
            lr = w.local_rank
            cmds[lr] = self._spec.worker_cmd(lr)
            envs[lr] = worker_env(self._base_env, w, group, restarts, error_files.get(lr, ""), opts)
            for watchdog in self._watchdogs:
                envs[lr].update(watchdog.env(lr))
        return cmds, envs
