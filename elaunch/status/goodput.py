"""``elaunch status``'s GOODPUT: each node's goodput ledger from its ``events.jsonl``, and the job's.

Each agent publishes its log directory in its ``agent`` record (``log_dir``); its
event log is ``<log_dir>/events.jsonl`` (docs/events.md). Where that file can be
read from the machine running ``elaunch status`` (the same host, or a shared file
system), the node's events are folded by :func:`elaunch.agent.ledger.ledger_of`:
a live node's until the read (``read_at``), a dead node's until its last event.
The job's goodput is the sum of productive seconds over the sum of seconds of the
nodes read. Stdlib only; reads files, never the rendezvous.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from elaunch.agent.ledger import CATEGORIES, ledger_of

#: The event log's name in an agent's log directory (``elaunch.agent.events.EVENTS_FILE``).
EVENTS_FILE = "events.jsonl"


def read_events(path: str) -> list[dict] | None:
    """The events in ``path`` in the order written (lines that do not parse are skipped); None: unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    events = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed agent
        if isinstance(e, dict) and isinstance(e.get("time"), (int, float)) and "kind" in e:
            events.append(e)
    return events


def node_ledger(node: Mapping, now: float) -> dict | None:
    """``ledger_of`` a report's ``nodes`` entry (its ``log_dir``, ``node`` id, ``dead``); None: no readable log.

    Only the events of that node id are folded when the file holds any (else all of them).
    """
    log_dir = node.get("log_dir")
    if not log_dir or log_dir == os.devnull:
        return None
    events = read_events(os.path.join(log_dir, EVENTS_FILE))
    if not events:
        return None
    mine = [e for e in events if e.get("node") == node.get("node")] or events
    return ledger_of(mine, None if node.get("dead") else now)


def add_goodput(report: dict) -> dict:
    """Add ``goodput`` to each of ``report``'s nodes (:func:`node_ledger`) and the job's to the report.

    Returns:
        ``report``, with ``nodes[].goodput`` (``{"goodput", "seconds"}`` or null) and
        ``goodput`` (``{"goodput", "seconds", "nodes_read"}``: the sums over the nodes read).
    """
    total = dict.fromkeys(CATEGORIES, 0.0)
    read = 0
    for node in report["nodes"]:
        node["goodput"] = node_ledger(node, report["read_at"])
        if node["goodput"] is not None:
            read += 1
            for k, v in node["goodput"]["seconds"].items():
                total[k] += v
    seconds = sum(total.values())
    report["goodput"] = {"goodput": total["productive"] / seconds if seconds > 0 else None, "seconds": total,
                         "nodes_read": read}
    return report
