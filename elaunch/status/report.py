"""The status report: pure functions from a read of the rendezvous to a JSON object and a table.

:func:`build` turns a :class:`~elaunch.status.read.Snapshot` into the report
(its schema is in ``docs/status.md``, version :data:`SCHEMA`); :func:`table`
renders it for a person; :func:`group_stacks` folds the agents' stack answers
into identical stacks with the ranks that share them. No I/O. Stdlib only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from elaunch.rendezvous.dynamic.state import RendezvousState

#: Version of the ``--json`` object's layout.
SCHEMA = 1
#: A node without node info (a corrupt state): its fields are reported as null.
_NO_INFO = (None, None, None)
#: Round states, as the report names them.
WAITING, RUNNING, CLOSED, FAILED = "waiting", "running", "closed", "failed"


def round_state(state: RendezvousState) -> str:
    """``failed`` (the job was declared failed), ``closed`` (finished or closed), ``running`` (the round
    completed and runs), or ``waiting`` (the round is forming)."""
    if state.job_failed:
        return FAILED
    if state.closed:
        return CLOSED
    return RUNNING if state.complete else WAITING


def agent_pid(node_id: str) -> int | None:
    """The agent's pid in a dynamic node id ``{addr}_{pid}_{n}`` (None when it does not parse)."""
    parts = node_id.rsplit("_", 2)
    try:
        return int(parts[1]) if len(parts) == 3 else None
    except ValueError:
        return None


def _ranks(state: RendezvousState, node: str, agent: Mapping | None) -> list[int]:
    """The node's global ranks: from its agent record of this round, else from the group ranks
    (contiguous per node in group-rank order, as ``agent.ranks.assign_ranks``)."""
    if agent is not None and agent.get("round") == state.round and isinstance(agent.get("ranks"), list):
        return [int(r) for r in agent["ranks"]]
    if not state.complete:
        return []
    start = 0
    for other, _rank in sorted(state.participants.items(), key=lambda kv: kv[1]):
        size = state.node_infos.get(other, _NO_INFO)[2] or 0
        if other == node:
            return list(range(start, start + size))
        start += size
    return []


def _age(state: RendezvousState, node: str, now: float) -> float | None:
    beat = state.last_heartbeats.get(node)
    return None if beat is None else max(0.0, now - beat)


def _checkpoint(record: Mapping | None, now: float) -> dict | None:
    """A node's in-memory checkpoints from its ``checkpoint`` record: ``step`` (its newest, or null), ``age``
    (seconds since that step was saved, or null) and ``bytes`` (shared memory held); None without a record."""
    if not isinstance(record, Mapping):
        return None
    step, at, held = record.get("step"), record.get("time"), record.get("bytes")
    return {"step": step if isinstance(step, int) else None,
            "age": max(0.0, now - at) if isinstance(at, (int, float)) and isinstance(step, int) else None,
            "bytes": held if isinstance(held, int) else None}


def build(state: RendezvousState, agents: Mapping[str, Mapping], *, backend: str, endpoint: str, run_id: str,
          now: float, dead_after: float, checkpoints: Mapping[str, Mapping] | None = None,
          node_checks: Mapping[str, Mapping] | None = None, stragglers: Mapping[str, Mapping] | None = None) -> dict:
    """Return the report object (the ``--json`` output) of one read.

    Args:
        agents: node id -> ``agent`` record published by that node's agent.
        now: when the state was read, seconds since the epoch.
        dead_after: seconds without a heartbeat after which a node counts as dead.
        checkpoints: node id -> ``checkpoint`` record published by that node's agent (in-memory checkpoints).
        node_checks: node id -> ``node_check`` record published by that node's agent (``--node-check``).
        stragglers: node id -> ``straggler`` record published by that node's agent (the straggler watch).
    """
    checkpoints = checkpoints or {}
    node_checks = {n: r for n, r in (node_checks or {}).items() if isinstance(r, Mapping)}
    nodes = []
    for node, group_rank in sorted(state.participants.items(), key=lambda kv: (kv[1], kv[0])):
        addr, role, size = state.node_infos.get(node, _NO_INFO)
        agent = agents.get(node)
        age = _age(state, node, now)
        nodes.append({
            "node": node, "addr": addr, "pid": agent_pid(node),
            "role": role, "local_world_size": size,
            "group_rank": group_rank if state.complete else None,
            "ranks": _ranks(state, node, agent),
            "joined_at": agent.get("joined_at") if agent and agent.get("round") == state.round else None,
            "heartbeat_age": age, "dead": age is not None and age > dead_after,
            "log_dir": agent.get("log_dir") if agent else None,
            "checkpoint": _checkpoint(checkpoints.get(node), now),
            "node_check": _node_check(node_checks.get(node)),
        })
    waiting = []
    for node in sorted(state.wait_list | state.redundancy_list):
        age = _age(state, node, now)
        waiting.append({"node": node, "addr": state.node_infos.get(node, _NO_INFO)[0], "pid": agent_pid(node),
                        "list": "wait" if node in state.wait_list else "redundant",
                        "heartbeat_age": age, "dead": age is not None and age > dead_after})
    budgets = sorted({int(a["max_restarts"]) for n, a in agents.items()
                      if n in state.participants and isinstance(a.get("max_restarts"), int)})
    return {
        "schema": SCHEMA,
        "backend": backend, "endpoint": endpoint, "run_id": run_id, "read_at": now,
        "round": state.round, "state": round_state(state),
        "last_call_deadline": state.deadline if not state.complete else None,
        "nodes": nodes, "waiting": waiting,
        "restarts": {"used": state.restarts, "max": min(budgets) if budgets else None, "budgets": budgets},
        "failure": state.failure, "job_failed": state.job_failed,
        "node_check": _last_check(node_checks),
        "stragglers": _stragglers(stragglers or {}, state.round),
    }


def _stragglers(records: Mapping[str, Mapping], round: int) -> dict | None:
    """The newest ``straggler`` record of the current round (every node's names the same ranks): ``at``,
    ``stragglers`` (global ranks), ``named`` (rank -> ``node``, ``host``, ``lateness``), ``step_time``; None: none."""
    mine = [r for r in records.values() if isinstance(r, Mapping) and r.get("round") == round
            and isinstance(r.get("at"), (int, float))]
    if not mine:
        return None
    last = max(mine, key=lambda r: r["at"])
    named = last.get("named") if isinstance(last.get("named"), Mapping) else {}
    return {"at": last["at"], "stragglers": list(last.get("stragglers") or ()), "named": dict(named),
            "step_time": last.get("step_time")}


def straggler_lines(report: Mapping) -> list[str]:
    """The ``stragglers`` line(s) of the table: none named (after one was), or one line per named rank."""
    s = report.get("stragglers")
    if s is None:
        return []
    if not s["stragglers"]:
        return [f"stragglers: none (the last named one recovered at {_when(s['at'])})"]
    lines = [f"stragglers: {len(s['stragglers'])} rank(s) named at {_when(s['at'])}"]
    for rank in s["stragglers"]:
        n = s["named"].get(str(rank), {})
        step = s.get("step_time")
        late = n.get("lateness")
        how = f"late by {late:.2f} of a step" if isinstance(late, (int, float)) else "late"
        if isinstance(late, (int, float)) and isinstance(step, (int, float)):
            how += f" ({late * step:.3g} s of {step:.3g} s)"
        lines.append(f"  rank {rank} on {n.get('host', '?')} (node {n.get('node', '?')}): {how}")
    return lines


def _node_check(record: Mapping | None) -> dict | None:
    """A node's last ``--node-check`` verdict from its ``node_check`` record: ``round``, ``verdict``, ``reasons``."""
    if record is None or not isinstance(record.get("round"), int):
        return None
    return {"round": record["round"], "verdict": str(record.get("verdict")),
            "reasons": list(record.get("reasons") or ())}


def _last_check(records: Mapping[str, Mapping]) -> dict | None:
    """The newest check's faulty nodes (every node's record of a round lists them alike): ``round``, ``faulty``
    (node id -> ``verdict``, ``reasons``, ``addr``, ``sits_out``); None when no node published one."""
    rounds = [r for r in records.values() if isinstance(r.get("round"), int)]
    if not rounds:
        return None
    last = max(rounds, key=lambda r: r["round"])
    faulty = last.get("faulty") if isinstance(last.get("faulty"), Mapping) else {}
    return {"round": last["round"], "faulty": dict(faulty)}


def node_check_lines(report: Mapping) -> list[str]:
    """The ``node check`` lines of the table: the last check's round, then one line per faulty node."""
    c = report.get("node_check")
    if c is None:
        return []
    if not c["faulty"]:
        return [f"node check (round {c['round']}): every node ok"]
    lines = [f"node check (round {c['round']}): {len(c['faulty'])} node(s) named"]
    for node, f in sorted(c["faulty"].items()):
        lines.append(f"  {f.get('addr') or node} ({node}): {f.get('verdict')}: {'; '.join(f.get('reasons') or ())}"
                     + (" (sits out)" if f.get("sits_out") else ""))
    return lines


def _when(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


def _secs(age: float | None, dead: bool) -> str:
    return "-" if age is None else f"{age:.1f} s" + (" DEAD" if dead else "")


def _keeps(c: Mapping | None) -> bool:
    return bool(c) and (c.get("step") is not None or bool(c.get("bytes")))


def _checkpoint_cells(c: Mapping | None) -> list[str]:
    """STEP, STEP AGE and SNAPSHOTS (MiB of shared memory held) of a node's ``checkpoint`` entry."""
    if not c:
        return ["-", "-", "-"]
    held = c.get("bytes")
    return [str(c["step"]) if c.get("step") is not None else "-", _secs(c.get("age"), False),
            f"{held / 2**20:.1f} MiB" if held is not None else "-"]


def _share(g: Mapping | None) -> str:
    """A ``goodput`` entry's goodput as a percentage, or ``-``."""
    return "-" if not g or g.get("goodput") is None else f"{g['goodput']:.1%}"


def goodput_line(report: Mapping) -> str | None:
    """The job's goodput line (None: the report has no goodput): the share, productive of all node-seconds, the lost
    time by category, and how many nodes' event logs were read."""
    g = report.get("goodput")
    if g is None:
        return None
    nodes = len(report["nodes"])
    if not g.get("nodes_read"):
        return ("goodput: unknown (no node's events.jsonl is readable here; run elaunch status on a node's host "
                "or where the log directories are shared)") if nodes else None
    s = g["seconds"]
    lost = ", ".join(f"{k} {v:.1f} s" for k, v in s.items() if k != "productive" and v > 0)
    return (f"goodput: {_share(g)} (productive {s['productive']:.1f} s of {sum(s.values()):.1f} node-seconds"
            + (f"; lost: {lost}" if lost else "") + f"; event logs of {g['nodes_read']} of {nodes} node(s))")


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def table(report: Mapping) -> str:
    """Render the report for a terminal: a header, the nodes, the waiting nodes, restarts, the last failure."""
    lines = [f"rendezvous {report['run_id']!r} ({report['backend']} at {report['endpoint']})",
             f"round {report['round']}: {report['state']}"
             + (f" (last call closes at {_when(report['last_call_deadline'])})"
                if report["state"] == WAITING and report["last_call_deadline"] else "")]
    nodes = report["nodes"]
    if nodes:
        rows = [[str(n["group_rank"]) if n["group_rank"] is not None else "-", n["addr"] or "-",
                 str(n["pid"]) if n["pid"] is not None else "-", _ranks_text(n["ranks"]), _when(n["joined_at"]),
                 _secs(n["heartbeat_age"], n["dead"])] for n in nodes]
        header = ["NODE", "ADDRESS", "AGENT PID", "RANKS", "JOINED", "HEARTBEAT AGE"]
        if any(_keeps(n.get("checkpoint")) for n in nodes):  # in-memory checkpoints' columns, once a node keeps any
            header += ["STEP", "STEP AGE", "SNAPSHOTS"]
            for row, n in zip(rows, nodes):
                row += _checkpoint_cells(n.get("checkpoint"))
        if any(n.get("node_check") for n in nodes):  # --node-check: each node's last verdict
            header.append("CHECK")
            for row, n in zip(rows, nodes):
                row.append(n["node_check"]["verdict"] if n.get("node_check") else "-")
        if any(n.get("goodput") for n in nodes):  # where a node's event log could be read
            header.append("GOODPUT")
            for row, n in zip(rows, nodes):
                row.append(_share(n.get("goodput")))
        lines += ["", *_rows(header, rows)]
    else:
        lines += ["", "no nodes in this round"]
    waiting = report["waiting"]
    if waiting:
        rows = [[w["addr"] or "-", str(w["pid"]) if w["pid"] is not None else "-",
                 "waiting for the next round" if w["list"] == "wait" else "redundant (world at max nodes)",
                 _secs(w["heartbeat_age"], w["dead"])] for w in waiting]
        lines += ["", f"{len(waiting)} node(s) waiting to join:",
                  *_rows(["ADDRESS", "AGENT PID", "", "HEARTBEAT AGE"], rows)]
    else:
        lines += ["", "nodes waiting to join: none"]
    r = report["restarts"]
    if r["max"] is None:
        lines.append(f"restarts used: {r['used']} (budget unknown: no agent record read)")
    else:
        differ = f" (agents disagree: --max-restarts {', '.join(map(str, r['budgets']))})" if len(r["budgets"]) > 1 else ""
        lines.append(f"restarts used: {r['used']} of {r['max']}{differ}")
    line = goodput_line(report)
    if line is not None:
        lines.append(line)
    lines += node_check_lines(report)
    lines += straggler_lines(report)
    f = report["failure"]
    if f is None:
        lines.append("last failure: none")
    else:
        how = f"exitcode {f.get('exitcode')}" + (" (hung)" if f.get("hung") else "")
        lines.append(f"last failure: round {f.get('round')}, rank {f.get('rank')} on {f.get('host')} "
                     f"(pid {f.get('pid')}), {how} at {_when(f.get('at'))}"
                     + ("; the job failed" if report["job_failed"] else ""))
        message = str(f.get("message") or "").strip()
        if message:
            lines += ["  " + line for line in message.splitlines()[-12:]]
    return "\n".join(lines)


def group_stacks(docs: Mapping[str, Mapping]) -> list[dict]:
    """Group the workers' stacks of the agents' ``stacks`` records: identical ones (after
    ``procs.stacks.normalise_stacks``) once, with the ranks that share them.

    Returns:
        ``[{"ranks": [global ranks, sorted], "text": normalised stacks}, ...]`` in the order of
        each group's lowest rank.
    """
    from elaunch.procs.stacks import group_identical

    texts: dict[int, str] = {}
    for doc in docs.values():
        for w in doc.get("workers", []):
            text = w.get("text") or f"(no stacks: {w.get('reason') or w.get('method')})"
            texts[int(w.get("rank", -1))] = text
    groups = group_identical({rank: texts[rank] for rank in sorted(texts)})
    return [{"ranks": sorted(ranks), "text": text} for text, ranks in groups]


def stacks_text(groups: list[dict], missing: list[str]) -> str:
    """Render grouped stacks: a header per group naming its ranks, then the stack once."""
    lines = []
    for g in groups:
        ranks = g["ranks"]
        lines += ["", f"=== {'rank' if len(ranks) == 1 else 'ranks'} {_ranks_text(ranks)} "
                      f"({len(ranks)} worker{'s' if len(ranks) != 1 else ''}) ===", g["text"]]
    if not groups:
        lines += ["", "no stacks received"]
    if missing:
        lines += ["", f"no stacks from node(s) {', '.join(missing)}"]
    return "\n".join(lines)
