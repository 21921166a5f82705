"""What a timeline shows, read from agents' ``events.jsonl`` files (docs/events.md): lanes, spans, marks.

Pure data and stdlib only; :mod:`elaunch.timeline.svg` and :mod:`elaunch.timeline.png`
draw it. Times are seconds since the earliest event of all files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from elaunch.agent.ledger import CATEGORIES, ledger_end, ledgers

#: The file each agent writes in its run's log directory (``elaunch.agent.events.EVENTS_FILE``).
EVENTS_FILE = "events.jsonl"

#: Mark kind -> (legend label, colour, shape); shapes: x, tri, diamond, square, circle, star.
MARKS: dict[str, tuple[str, str, str]] = {
    "failure": ("worker failed", "#d62728", "x"),
    "hang": ("hang", "#e377c2", "square"),
    "restart": ("restart (counted)", "#ff7f0e", "tri"),
    "reform": ("re-form (not counted)", "#bcbd22", "tri"),
    "membership": ("membership change", "#9467bd", "diamond"),
    "notice": ("notice (forwarded signal)", "#1f77b4", "circle"),
    "job_failed": ("job failed", "#7f0000", "star"),
    "job_succeeded": ("job succeeded", "#2ca02c", "star"),
    "not_needed": ("node not needed", "#7f7f7f", "circle"),
    "node_ok": ("node check: every node ok", "#17becf", "square"),
    "node_faulty": ("node check: a node named", "#8c564b", "square"),
    "restore": ("checkpoint restored (where from)", "#006d2c", "circle"),
    "inprocess": ("in-process restart (survivors kept)", "#e6550d", "diamond"),
    "persisted": ("checkpoint persisted", "#08519c", "diamond"),
}
#: Span kind -> (legend label, colour).
SPANS: dict[str, tuple[str, str]] = {
    "rendezvous": ("in rendezvous", "#d9d9d9"),
    "round": ("round (rN)", "#c6dbef"),
    "worker_ok": ("worker, exited 0 / running", "#a1d99b"),
    "worker_failed": ("worker, failed", "#fc9272"),
    "worker_stopped": ("worker, stopped by the agent", "#bdbdbd"),
}


#: Goodput ledger category -> (legend label, colour): productive green, lost time in greys and warm colours.
LEDGER: dict[str, tuple[str, str]] = {
    "productive": ("productive", "#2ca02c"),
    "rendezvous": ("lost: rendezvous", "#969696"),
    "starting": ("lost: starting", "#fdd0a2"),
    "restoring": ("lost: restoring (redoing lost steps)", "#fd8d3c"),
    "hung": ("lost: hung", "#e377c2"),
    "stopped": ("lost: stopped", "#525252"),
}
assert tuple(LEDGER) == CATEGORIES


class TimelineError(ValueError):
    """Bad input to ``elaunch timeline``: the message names the path."""


@dataclass
class Lane:
    """One node's row: its rounds, rendezvous waits, workers (one row per local rank) and marks.

    Attributes:
        node, host: the events' ``node`` and ``host`` fields.
        spans: (kind, start, end, label, row); row -1 is the lane's round band, n >= 0 local rank n.
        marks: (kind, time, label, row); row as for spans (a failure sits on its worker's row).
        rows: number of worker rows (the largest local rank + 1).
        ledger: the goodput ledger as (category, start, end) runs (:mod:`elaunch.agent.ledger`).
        seconds: the ledger's seconds per category; goodput: productive / total (None: no time).
    """

    node: str
    host: str
    spans: list[tuple[str, float, float, str, int]] = field(default_factory=list)
    marks: list[tuple[str, float, str, int]] = field(default_factory=list)
    rows: int = 0
    ledger: list[tuple[str, float, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    goodput: float | None = None


@dataclass
class Timeline:
    """Lanes (ordered by each node's first event) over ``[0, end]`` seconds after ``t0`` (epoch seconds).

    ``goodput``: the job's, sum of productive seconds over sum of seconds of every lane (None: no time).
    """

    lanes: list[Lane]
    t0: float
    end: float
    goodput: float | None = None


def find_event_files(paths: list[str]) -> list[str]:
    """Every ``events.jsonl`` under ``paths`` (directories searched recursively, or the files themselves).

    Raises:
        TimelineError: a path does not exist, or none of them holds an event file.
    """
    found: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                if EVENTS_FILE in files:
                    found.append(os.path.join(root, EVENTS_FILE))
        else:
            raise TimelineError(f"{path}: no such file or directory")
    unique = list(dict.fromkeys(os.path.realpath(f) for f in found))
    if not unique:
        raise TimelineError(f"no {EVENTS_FILE} under {', '.join(paths)}")
    return unique


def read_events(files: list[str]) -> list[dict]:
    """The events of ``files``; lines that are not a JSON event are skipped (a line cut by a killed agent,
    one whose fields have the wrong types: see :func:`well_formed`).

    Args:
        files: paths of ``events.jsonl`` files.

    Returns:
        The :func:`well_formed` events (dicts), file by file in the order written.

    Raises:
        TimelineError: a file cannot be read, or no file holds a single event.
    """
    events = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if well_formed(e):
                        events.append(e)
        except OSError as exc:
            raise TimelineError(f"{path}: {exc.strerror or exc}") from None
    if not events:
        raise TimelineError(f"no events in {', '.join(files)}")
    return events


#: The latest ``time`` drawn: 9999-12-30 UTC, the last day :mod:`datetime` shows in every time zone.
MAX_TIME = 253402128000.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """A finite int or float (JSON's ``NaN`` and ``Infinity`` are not; a bool is not)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_time(v: object) -> bool:
    return _is_number(v) and 0 <= v <= MAX_TIME  # type: ignore[operator]


def _opt(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def _list_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


def _is_dict(v: object) -> bool:
    return isinstance(v, dict)


def _is_local_rank(v: object) -> bool:
    return _is_int(v) and v >= 0  # type: ignore[operator]


def _is_seconds(v: object) -> bool:
    return _is_number(v) and v >= 0  # type: ignore[operator]


_INT, _OPT_INT, _STR, _OPT_STR, _INTS = _is_int, _opt(_is_int), _is_str, _opt(_is_str), _list_of(_is_int)
#: Fields every event may have (docs/events.md) -> the check of its value.
_COMMON: dict[str, Callable[[object], bool]] = {"kind": _STR, "node": _STR, "host": _STR, "round": _INT}
#: Kind -> the fields of it this module or the goodput ledger reads -> the check of its value.
_FIELDS: dict[str, dict[str, Callable[[object], bool]]] = {
    "workers_started": {"ranks": _INTS, "local_ranks": _list_of(_is_local_rank), "pids": _INTS},
    "worker_exited": {"rank": _INT, "local_rank": _is_local_rank, "pid": _OPT_INT, "exitcode": _OPT_INT,
                      "signal": _OPT_STR, "stopped": _is_bool, "step": _OPT_INT},
    "restart": {"counted": _is_bool, "count": _OPT_INT, "budget": _INT, "cause": _STR,
                "failure": _opt(_is_dict), "step": _OPT_INT},
    "membership_change": {"came": _list_of(_STR), "left": _list_of(_STR)},
    "node_check": {"seconds": _is_number, "faulty": _list_of(_STR), "sitting_out": _list_of(_STR),
                   "nodes": lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())},
    "hang": {"ranks": _INTS, "stuck": _is_bool, "quiet_seconds": _opt(_is_seconds)},
    "checkpoint_restore": {"step": _INT, "sources": lambda v: isinstance(v, dict)
                           and all(isinstance(x, str) for x in v.values())},
    "checkpoint_persisted": {"step": _INT, "path": _STR, "seconds": _is_number},
    "inprocess_restart": {"kept": _INTS, "started": _INTS, "seconds": _is_number},
    "training": {"step": _OPT_INT},
    "caught_up": {"step": _OPT_INT},
    "notice": {"signal": _OPT_STR},
    "job_succeeded": {"restarts": _INT},
    "job_failed": {"restarts": _INT, "failure": _opt(_is_dict), "signal": _OPT_STR, "error": _OPT_STR},
}


def well_formed(e: object) -> bool:
    """Whether ``e`` (one parsed line of ``events.jsonl``) is an event the timeline draws.

    It is a dict with a ``kind`` (a string) and a ``time`` (seconds since the epoch: a
    finite number from 0 to :data:`MAX_TIME`, not a bool), and each field the timeline
    reads has its type of docs/events.md where present (``round`` an int, ``ranks`` a
    list of ints, ``failure`` an object or null, ...). A field that is absent is not
    checked (its default is drawn); fields the timeline does not read are not checked.

    Args:
        e: any JSON value.

    Returns:
        True for an event to draw, False for a line to skip. Never raises.
    """
    if not isinstance(e, dict) or not _is_str(e.get("kind")) or not _is_time(e.get("time")):
        return False
    checks = {**_COMMON, **_FIELDS.get(e["kind"], {})}
    return all(check(e[name]) for name, check in checks.items() if name in e)


def build(events: list[dict]) -> Timeline:
    """Lay ``events`` (of one or more nodes, each :func:`well_formed`; at least one) out as a :class:`Timeline`.

    Raises:
        ValueError: ``events`` is empty (``min()`` of nothing).
        TypeError, ValueError, AttributeError: an event that is not :func:`well_formed`.
    """
    t0 = min(e["time"] for e in events)
    end = max(e["time"] for e in events) - t0
    by_node: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        by_node.setdefault(str(e.get("node", "?")), []).append(e)
    lanes = [_lane(node, evs, t0) for node, evs in by_node.items()]
    folded = ledgers(events)  # each node's events in the order written (the ledger's input), not sorted
    for lane in lanes:
        led = folded.get(lane.node)
        if led is not None:
            until = ledger_end(led, None)
            lane.ledger = [(cat, a - t0, b - t0) for a, b, cat in led.segments(until)]
            lane.seconds, lane.goodput = led.seconds(until), led.goodput(until)
    total = sum(sum(lane.seconds.values()) for lane in lanes)
    productive = sum(lane.seconds.get("productive", 0.0) for lane in lanes)
    return Timeline(lanes=lanes, t0=t0, end=max(end, 1e-3), goodput=productive / total if total > 0 else None)


def _lane(node: str, events: list[dict], t0: float) -> Lane:
    lane = Lane(node=node, host=str(events[0].get("host", "")))
    joining: float | None = None
    current: tuple[float, int] | None = None  # the open round: (start, number)
    running: dict[object, tuple[int, float, int]] = {}  # pid -> (local rank, start, rank)
    last = events[-1]["time"] - t0

    def close_round(t: float) -> None:
        nonlocal current
        if current is not None:
            lane.spans.append(("round", current[0], t, f"r{current[1]}", -1))
            current = None

    for e in events:
        t, kind = e["time"] - t0, e["kind"]
        if kind == "rendezvous_join":
            close_round(t)
            joining = t
        elif kind == "rendezvous_complete":
            if joining is not None:
                lane.spans.append(("rendezvous", joining, t, "", -1))
            joining, current = None, (t, int(e.get("round", -1)))
        elif kind == "workers_started":
            for lr, rank, pid in zip(e.get("local_ranks", ()), e.get("ranks", ()), e.get("pids", ())):
                running.setdefault(pid, (int(lr), t, rank))  # a survivor of an in-process restart: its bar goes on
                lane.rows = max(lane.rows, int(lr) + 1)
        elif kind == "worker_exited":
            lr, start, rank = running.pop(e.get("pid"), (int(e.get("local_rank", 0)), t, e.get("rank")))
            code, stopped = e.get("exitcode"), bool(e.get("stopped"))
            state = "worker_stopped" if stopped else "worker_ok" if code == 0 else "worker_failed"
            lane.spans.append((state, start, t, f"rank {rank}", lr))
            lane.rows = max(lane.rows, lr + 1)
            if state == "worker_failed":
                why = e.get("signal") or f"exitcode {code}"
                lane.marks.append(("failure", t, f"rank {rank} failed ({why})", lr))
        elif kind in _MARKERS:
            lane.marks.append((*_MARKERS[kind](e, t), -1))
            if kind in ("job_failed", "job_succeeded", "node_not_needed"):
                close_round(t)
    close_round(last)
    if joining is not None:
        lane.spans.append(("rendezvous", joining, last, "", -1))
    for pid, (lr, start, rank) in running.items():
        lane.spans.append(("worker_ok", start, last, f"rank {rank}", lr))
    return lane


def _restart(e: dict, t: float) -> tuple[str, float, str]:
    f = e.get("failure") or {}
    if not e.get("counted"):
        return "reform", t, f"re-form ({e.get('cause', '?')}), not counted"
    cause = f" after rank {f.get('rank')} on {f.get('host')} failed" if f else ""
    return "restart", t, f"restart {e.get('count')}/{e.get('budget')}{cause}"


def _membership(e: dict, t: float) -> tuple[str, float, str]:
    came, left = e.get("came") or [], e.get("left") or []
    parts = [f"+{', '.join(map(str, came))}" if came else "", f"-{', '.join(map(str, left))}" if left else ""]
    return "membership", t, "membership " + " ".join(p for p in parts if p)


def _job_failed(e: dict, t: float) -> tuple[str, float, str]:
    f = e.get("failure") or {}
    why = (f"rank {f.get('rank')} on {f.get('host')}" if f else e.get("signal") or e.get("error") or "")
    return "job_failed", t, f"job failed: {why}" if why else "job failed"


def _node_check(e: dict, t: float) -> tuple[str, float, str]:
    faulty, out = e.get("faulty") or [], e.get("sitting_out") or []
    took = f" in {e['seconds']:.1f} s" if isinstance(e.get("seconds"), (int, float)) else ""
    if not faulty:
        return "node_ok", t, f"node check{took}: every node ok"
    named = ", ".join(f"{n} ({(e.get('nodes') or {}).get(n, {}).get('verdict', '?')}"
                      f"{', sits out' if n in out else ''})" for n in faulty)
    return "node_faulty", t, f"node check{took}: {named}"


def _restore(e: dict, t: float) -> tuple[str, float, str]:
    sources = e.get("sources") or {}
    where: dict[str, list[str]] = {}
    for rank, kind in sources.items():
        where.setdefault(str(kind), []).append(str(rank))
    parts = ", ".join(f"{kind} (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})"
                      for kind, ranks in where.items())
    return "restore", t, f"restore of step {e.get('step')}" + (f": {parts}" if parts else "")


def _persisted(e: dict, t: float) -> tuple[str, float, str]:
    took = f" in {e['seconds']:.2f} s" if isinstance(e.get("seconds"), (int, float)) else ""
    return "persisted", t, f"step {e.get('step')} persisted{took} to {e.get('path')}"


_MARKERS = {
    "checkpoint_restore": _restore,
    "checkpoint_persisted": _persisted,
    "inprocess_restart": lambda e, t: ("inprocess", t, f"in-process restart: ranks {e.get('kept')} kept, "
                                                      f"{e.get('started')} started, {e.get('seconds')} s"),
    "restart": _restart,
    "node_check": _node_check,
    "membership_change": _membership,
    "hang": lambda e, t: ("hang", t, f"{'stuck (D state)' if e.get('stuck') else 'hang'}: ranks "
                                     f"{', '.join(map(str, e.get('ranks', ())))}"),
    "notice": lambda e, t: ("notice", t, f"notice {e.get('signal')}"),
    "job_failed": _job_failed,
    "job_succeeded": lambda e, t: ("job_succeeded", t, f"job succeeded ({e.get('restarts', 0)} restarts)"),
    "node_not_needed": lambda e, t: ("not_needed", t, "node not needed"),
}


def nice_ticks(end: float, count: int = 8) -> list[float]:
    """Round tick positions (1, 2 or 5 times a power of ten apart) covering ``[0, end]`` seconds."""
    import math

    raw = max(end, 1e-9) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(end / step + 1e-9) + 1)]
