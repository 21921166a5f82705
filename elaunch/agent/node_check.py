"""``--node-check``: after a round forms and before the workers start, check every node (issue 26).

One child per node (``procs/_node_check_child.py``, a :class:`~elaunch.procs.helper_process.HelperProcess`
registered with the reaper) is started as the agent joins a round, so it imports torch
while the rendezvous runs; once the round formed, :meth:`NodeCheck.run` sends it the
round's facts, and the children time a compute probe and all-reduces between pairs of
nodes over the round's workers' store. Each agent then exchanges its node's result
through the job channel (``JobChannel.exchange``, as the in-memory checkpoints' restore
does) and calls the pure :func:`~elaunch.agent.node_verdict.judge` on the same documents,
so every node reaches the same verdicts. A faulty node is named: one WARNING line each,
the ``node_check`` event (docs/events.md), and its ``node_check`` record, which
``elaunch status`` shows. Whether it sits out is :func:`~elaunch.agent.node_verdict.sitting_out`'s
answer, applied by the agent.

**Time budget.** The children wait up to :data:`IMPORT_GRACE` seconds for each other
(one may still import torch), then each has :data:`CHECK_BUDGET` seconds for the check
(an all-reduce that does not finish in ``OP_TIMEOUT`` counts as failed); the agent waits
``IMPORT_GRACE + CHECK_BUDGET`` seconds for its child's result, then names its node
failed. A healthy check takes well under a second once torch is imported (the pairs
run in parallel: 0.9 s measured on 8 test hosts sharing 2 cores); the exchange then
waits up to :data:`EXCHANGE_TIMEOUT` seconds for a late node (twice that at most).

The check needs a backend that keeps job state (c10d, etcd): a static or standalone
job skips it with one warning, and a one-node round has nothing to compare. torchrun
has no such check. Stdlib only (the child imports torch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import time
from collections.abc import Callable

from elaunch.agent.node_verdict import OK, NodeCheckReport, judge, sitting_out
from elaunch.procs.helper_process import HelperProcess

log = logging.getLogger("elaunch.agent")

#: Seconds the check child has once every node's child is there (its probe, all-reduces, the last barrier).
CHECK_BUDGET = 20.0
#: Seconds the children wait for each other (one may still import torch when the round formed); the agent
#: waits this much more than CHECK_BUDGET for its child's result.
IMPORT_GRACE = 30.0
#: Seconds the agents wait for each other's results (``JobChannel.exchange``; at most twice this).
EXCHANGE_TIMEOUT = 10.0
_CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "procs", "_node_check_child.py")


class NodeCheck:
    """Runs the node check of each round for one agent.

    One helper of the agent's supervisor (``elaunch.supervision``, tier ``SERVICES``): a worker
    forked from the agent closes the channel to a child waiting for the next check
    (:meth:`private_fds`), and the supervisor stops it at the run's end (:meth:`close`).
    A child that died is found by :meth:`run` ("the check exited"), not by the monitor.

    Args:
        factor: ``node_check_slow_factor`` (> 1).
        exclude: True when the faulty nodes sit out (the conf key ``exclude_after`` was given, > 0).
        min_nodes: the job's MIN nodes (the faulty sit out only when the others still make it).
        channel: returns the rendezvous' job channel (exchange, node records).
        events: the agent's event log (``node_check`` events).
        reaper: the watchdog that kills the child if the agent dies (the launcher's), or None.
        budget, grace, exchange_timeout: seconds, see the constants.
        device: the child's ``device`` (``"auto"``: nccl on a GPU when torch sees one, else gloo).
        script: the child's program (``procs/_node_check_child.py``; tests give a broken one).
    """

    name = "node check"

    def __init__(self, factor: float, exclude: bool, min_nodes: int, channel: Callable[[], object], events,
                 reaper=None, *, budget: float = CHECK_BUDGET, grace: float = IMPORT_GRACE,
                 exchange_timeout: float = EXCHANGE_TIMEOUT, device: str = "auto", script: str = _CHILD) -> None:
        self._factor, self._exclude, self._min_nodes = factor, exclude, min_nodes
        self._channel, self._events, self._reaper = channel, events, reaper
        self._budget, self._grace, self._exchange_timeout, self._device = budget, grace, exchange_timeout, device
        self._script = script
        self._child: HelperProcess | None = None
        self._warned = False
        #: the node ids of the last round checked: a round of the same nodes is not checked again
        self._checked: frozenset = frozenset()

    def prepare(self) -> None:
        """Start the child (it imports torch meanwhile), unless one waits already; before joining a round.

        A child that cannot be started is logged (WARNING) and left out: :meth:`run` then
        reports this node's check as failed, so the others still name it.
        """
        if self._child is None and self._channel().keeps_job_state:
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
            child = HelperProcess("node check", self._script, env=env, reaper=self._reaper)
            try:
                child.start()
            except OSError as exc:
                log.warning("--node-check: the check could not start (%s)", exc)
                return
            self._child = child

    def run(self, info) -> tuple[NodeCheckReport | None, list[str]]:
        """Check the nodes of the round ``info`` (``RendezvousInfo``) formed; name the faulty ones.

        Returns:
            (the report, or None when no check ran: one node, no job state, or the
            nodes of the last checked round again; the node ids that sit out, the
            same on every node).
        """
        channel = self._channel()
        if not channel.keeps_job_state:
            if not self._warned and info.world_size > 1:
                self._warned = True
                log.warning("--node-check: this rendezvous cannot exchange the nodes' results (use c10d or etcd); "
                            "the nodes are not checked")
            return None, []
        if info.world_size < 2:
            self.close()  # one node: nothing to compare
            return None, []
        nodes = frozenset(channel.round_members)
        if nodes and nodes == self._checked:
            # a restart of the same nodes (a worker failed): they passed, or were named, already. Every node
            # of this round was in the checked one and decides alike; a new node makes every node check.
            # The child started for this round waits for the next check.
            log.info("node check: round %d has the nodes of the last checked round; not checked again", info.round)
            return None, []
        started = time.monotonic()
        doc = self._check(info)
        doc["group_rank"] = info.rank
        if info.nodes:
            doc["addr"] = info.nodes[info.rank].addr
        docs = channel.exchange("node_check", info.round, doc, self._exchange_timeout)
        members = {n: d["group_rank"] for n, d in docs.items() if type(d.get("group_rank")) is int}
        members.update({n: -1 for n in channel.round_members if n not in members})
        report = judge(info.round, members, docs, self._factor)
        out = sitting_out(report, self._exclude, self._min_nodes)
        self._tell(report, docs, out, time.monotonic() - started, channel)
        self._checked = nodes
        return report, out

    def _check(self, info) -> dict:
        """This node's result document: the child's, or one with an error naming what went wrong."""
        child, self._child = self._child, None
        if child is None:
            self.prepare()
            child, self._child = self._child, None
            if child is None:
                return {"error": "the check could not start"}
        try:
            facts = {"round": info.round, "rank": info.rank, "world_size": info.world_size,
                     "store": [info.master_addr, info.master_port], "host_store": not info.use_agent_store
                     and info.rank == 0, "addr": info.nodes[info.rank].addr if info.nodes else info.master_addr,
                     "device": self._device, "budget": self._budget, "ready_wait": self._grace}
            child.chan.send(json.dumps(facts).encode())
            ready, _, _ = select.select([child.chan], [], [], self._budget + self._grace)
            raw = child.chan.recv(1 << 16) if ready else b""
            if not ready:
                return {"error": f"no result within {self._budget + self._grace:g} s"}
            if not raw:
                return {"error": f"the check exited ({child.poll()})"}
            doc = json.loads(raw)
            return doc if isinstance(doc, dict) else {"error": "a malformed result"}
        except (OSError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            child.stop()

    def _tell(self, report: NodeCheckReport, docs: dict, out: list[str], seconds: float, channel) -> None:
        """The log lines, the ``node_check`` event and this node's ``node_check`` record."""
        fields = report.to_doc()
        for node, entry in fields["nodes"].items():
            entry["addr"] = docs.get(node, {}).get("addr")
            entry["check_seconds"] = _num(docs.get(node, {}).get("seconds"))
            entry["waited_seconds"] = _num(docs.get(node, {}).get("waited"))
        del fields["round"]
        self._events.emit("node_check", round=report.round, seconds=round(seconds, 3), sitting_out=out, **fields)
        me = channel.node_id
        for node in report.faulty:
            r = report.nodes[node]
            log.warning("node check of round %d: node %s (group rank %d%s) is %s: %s%s", report.round, node,
                        r.group_rank, f", {fields['nodes'][node]['addr']}" if fields["nodes"][node]["addr"] else "",
                        r.verdict, "; ".join(r.reasons), "; it sits out" if node in out else "")
        if not report.faulty:
            log.info("node check of round %d: %d nodes ok in %.2f s (median all-reduce %s s, compute %s s)",
                     report.round, len(report.nodes), seconds, fields["pair_median"], fields["compute_median"])
        mine = report.nodes.get(me)
        if mine is not None:  # for elaunch status: this node's verdict, and the faulty nodes (alike on every node)
            channel.publish_node_record("node_check", {
                "round": report.round, "at": time.time(), "verdict": mine.verdict, "reasons": list(mine.reasons),
                "faulty": {n: {**{k: fields["nodes"][n][k] for k in ("verdict", "reasons", "addr")},
                               "sits_out": n in out} for n in report.faulty}})

    def sit_out_or_reform(self, info, out: list[str], job) -> object | None:
        """Apply :meth:`run`'s ``out``: this node sits out if it is one of them, else the round re-forms without them.

        Args:
            info: the checked round (``RendezvousInfo``).
            out: the node ids that sit out (non-empty).
            job: the agent's ``JobView`` (``JobView.sit_out``: the bad-node exclusion's cooldown and watch).

        Returns:
            None: join the next round (after the cooldown, for a node that sat out); or the run's
            ``RunResult`` when the job ended while this node sat out.

        Raises:
            RendezvousClosedError: as ``JobView.sit_out``.
        """
        if self._channel().node_id in out:
            # CHECKED -> OUT: this node failed the node check; it sits out as a blamed node does
            return job.sit_out(f"this node failed the node check of round {info.round}")
        # CHECKED -> JOINING: the others re-form without the faulty node(s), uncounted
        log.warning("re-forming the round without %s (failed the node check; rdzv conf exclude_after is set)",
                    ", ".join(out))
        self._events.restart(False, job.restarts, "node_check")
        return None

    def check(self) -> bool:
        """Nothing to restart: a child that died names this node failed at :meth:`run`."""
        return False

    def private_fds(self) -> tuple[int, ...]:
        """The channel to a child waiting for the next check: a worker forked from the agent closes it."""
        child = self._child
        return child.private_fds() if child is not None else ()

    def close(self) -> None:
        """Stop a child still waiting (idempotent)."""
        child, self._child = self._child, None
        if child is not None:
            child.stop()


def _num(x) -> float | None:
    return round(float(x), 3) if isinstance(x, (int, float)) and math.isfinite(x) else None


def node_check_for(config, channel: Callable[[], object], events, reaper) -> NodeCheck | None:
    """The launch's :class:`NodeCheck` (``LaunchConfig``: ``node_check``, ``node_check_slow_factor``,
    ``rdzv_configs``' ``exclude_after``, ``min_nodes``), or None without ``--node-check``."""
    if not config.node_check:
        return None
    try:
        exclude = int(config.rdzv_configs.get("exclude_after", 0)) > 0
    except ValueError:
        exclude = False  # the backend rejects it with one line before a round forms
    return NodeCheck(config.node_check_slow_factor, exclude, config.min_nodes, channel, events, reaper)


__all__ = ["CHECK_BUDGET", "EXCHANGE_TIMEOUT", "IMPORT_GRACE", "NodeCheck", "OK", "node_check_for"]
