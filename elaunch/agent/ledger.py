"""The goodput ledger: every second of a node's part of the job in one category, folded from its events.

Pure and stdlib only: event dicts as written to ``events.jsonl`` (docs/events.md)
in, seconds per category out. The same fold runs live in the agent (the metrics
observe each event as it is written) and afterwards over the file
(``elaunch status``, ``elaunch timeline``), so the figures agree.

Categories (docs/metrics.md, "The goodput ledger", has the edge cases):

- ``rendezvous``: ``rendezvous_join`` until ``rendezvous_complete``;
- ``starting``: ``rendezvous_complete`` until ``training`` (rank assignment,
  restore plan, spawn, until every local rank called ``elaunch.progress()``);
- ``restoring``: after ``training`` of a group that follows a stop at a known step,
  until ``caught_up`` (the steps lost in the failure being done again);
- ``hung``: the ``quiet_seconds`` before a ``hang`` verdict (taken from
  productive or restoring time), and from the verdict until the group stopped;
- ``stopped``: from a group's first ``worker_exited`` (or ``restart``) until the
  next ``rendezvous_join``, and before the first transition;
- ``productive``: otherwise while workers run.

A node's part of the job ends at its ``job_succeeded``, ``job_failed`` or
``node_not_needed``: no second after it is counted.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The ledger's categories, in the order reports show them.
CATEGORIES = ("productive", "rendezvous", "starting", "restoring", "hung", "stopped")
#: Categories in which the workers look busy (a hang verdict moves its quiet time out of them).
_BUSY = ("productive", "restoring")
#: Events that end a node's part of the job.
END_KINDS = ("job_succeeded", "job_failed", "node_not_needed")


class Ledger:
    """One node's ledger, fed its events in the order they were written.

    Attributes:
        start: time of the first event (seconds since the epoch), None before any.
        end: time of the node's job-end event, None while it is in the job.
        last: time of the latest event (seconds since the epoch), None before any.
        state: the category of the time since the last transition (None before any event).
    """

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.last: float | None = None
        self.state: str | None = None
        self._since = 0.0  # when ``state`` began
        self._totals = dict.fromkeys(CATEGORIES, 0.0)  # of the closed segments
        self._segments: list[list] = []  # closed [start, end, category], in time order
        self._running = False  # a worker group runs (workers_started until its stop)
        self._behind = False  # a group stopped at a known step: the next group restores until caught_up

    def observe(self, event: dict) -> None:
        """Fold one event (a dict of ``events.jsonl``: ``time``, ``kind`` and the kind's fields).

        Events are taken in the order they were written; an event whose ``time`` is
        earlier than the current segment's start (``worker_exited`` lines are written
        after the group ended) counts from that start. Unknown kinds are ignored.
        """
        if self.end is not None:
            return
        t = float(event["time"])
        kind = event.get("kind")
        if self.start is None:
            self.start = self._since = t
            self.state = "stopped"
        t = max(t, self._since)
        self.last = t if self.last is None else max(self.last, t)
        if kind == "rendezvous_join":
            self._running = False
            self._to("rendezvous", t)
        elif kind in ("rendezvous_complete", "workers_started"):
            self._running = self._running or kind == "workers_started"
            if self.state in ("rendezvous", "stopped"):
                self._to("starting", t)
        elif kind == "training":
            if self.state == "starting":
                self._to("restoring" if self._behind else "productive", t)
        elif kind == "caught_up":
            self._behind = False
            if self.state == "restoring":
                self._to("productive", t)
        elif kind in ("worker_exited", "restart"):
            if event.get("step") is not None:
                self._behind = True
            if self._running:
                self._running = False
                self._to("stopped", t)
        elif kind == "hang":
            self._hang(t, float(event.get("quiet_seconds") or 0.0))
        elif kind in END_KINDS:
            self._to(self.state, t)
            self.end = t

    def _to(self, category: str, t: float) -> None:
        if t > self._since:
            self._close(self._since, t, self.state)
        self.state, self._since = category, t

    def _close(self, a: float, b: float, category: str) -> None:
        if self._segments and self._segments[-1][2] == category and self._segments[-1][1] == a:
            self._segments[-1][1] = b
        else:
            self._segments.append([a, b, category])
        self._totals[category] += b - a

    def _hang(self, t: float, quiet: float) -> None:
        """Relabel the busy time in ``[t - quiet, t]`` as hung; the group stays hung until it stops."""
        if not self._running:
            return
        self._to("hung", t)  # closes the open segment at t
        cut = t - quiet
        tail: list[list] = []
        while self._segments and self._segments[-1][1] > cut:
            seg = self._segments.pop()
            self._totals[seg[2]] -= seg[1] - seg[0]
            tail.append(seg)
            if seg[0] < cut:
                break
        for a, b, cat in reversed(tail):
            if a < cut:
                self._close(a, cut, cat)
                a = cut
            self._close(a, b, "hung" if cat in _BUSY else cat)

    def seconds(self, now: float) -> dict[str, float]:
        """Seconds per category from the first event until ``now`` (or the node's job end, if earlier).

        Every category is present; the values sum to ``min(now, end) - start`` (0 before any
        event) for a ``now`` at or after the latest event (an earlier one counts the time up
        to the latest transition whole).
        """
        out = {k: max(v, 0.0) for k, v in self._totals.items()}  # a hang's relabelling may leave -1e-16
        if self.state is not None and self.end is None and now > self._since:
            out[self.state] += now - self._since
        return out

    def goodput(self, now: float) -> float | None:
        """``productive / total`` until ``now``, or None when no time has passed."""
        s = self.seconds(now)
        total = sum(s.values())
        return s["productive"] / total if total > 0 else None

    def segments(self, now: float) -> list[tuple[float, float, str]]:
        """The ledger as ``(start, end, category)`` runs in time order (seconds since the epoch), until ``now``."""
        out = [tuple(s) for s in self._segments]
        if self.state is not None and self.end is None and now > self._since:
            out.append((self._since, now, self.state))
        return out


def ledgers(events: Iterable[dict]) -> dict[str, Ledger]:
    """One :class:`Ledger` per ``node`` field, each fed that node's events in the given order."""
    out: dict[str, Ledger] = {}
    for e in events:
        out.setdefault(str(e.get("node", "")), Ledger()).observe(e)
    return out


def ledger_end(ledger: Ledger, now: float | None) -> float:
    """Where a node's ledger is read: its job end, else ``now``, else the time of its last event."""
    if ledger.end is not None:
        return ledger.end
    return now if now is not None else (ledger.last or 0.0)


def ledger_of(events: Iterable[dict], now: float | None = None) -> dict:
    """Seconds per category and goodput of ``events`` (one node's, or several nodes': then summed over nodes).

    Args:
        events: event dicts in the order each node wrote them (``events.jsonl``).
        now: seconds since the epoch to count a node still in the job until; None: until
            its last event (a finished or dead agent's log).

    Returns:
        ``{"seconds": {category: seconds}, "goodput": productive / total or None}``; the
        job's goodput is the sum of productive seconds over the sum of all seconds.
    """
    total = dict.fromkeys(CATEGORIES, 0.0)
    for led in ledgers(events).values():
        for k, v in led.seconds(ledger_end(led, now)).items():
            total[k] += v
    all_seconds = sum(total.values())
    return {"seconds": total, "goodput": total["productive"] / all_seconds if all_seconds > 0 else None}
