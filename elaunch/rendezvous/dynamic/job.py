"""Job-wide facts in the rendezvous state: restart count, failure verdict, stack-dump requests.

Pure functions ``(state, ...) -> new state or None`` (None: nothing to write),
applied by the executor with compare-and-set like the ops of ``ops.py``. They
carry what one agent learns that the whole job must act on, so every agent sees
it in the state its monitor already reads (torch keeps none of this: each
agent counts its own restarts and a failed node's peers never hear of it).
Stdlib only.
"""

from __future__ import annotations

from elaunch.rendezvous.api import FailureRecord, JobState, RendezvousStateError
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

#: How many root causes ``RendezvousState.blame`` keeps (enough for any ``exclude_after``
#: worth using; a longer streak is still a streak of at least this many).
BLAME_KEPT = 16


def _record(doc: dict | None) -> FailureRecord | None:
    if doc is None:
        return None
    try:
        return FailureRecord.from_dict(doc)
    except (TypeError, ValueError, KeyError) as exc:
        raise RendezvousStateError(f"corrupt failure record in the rendezvous state {doc!r:.80}: {exc}") from exc


def _root(state: RendezvousState) -> FailureRecord | None:
    return _record(state.failure)


def count_failure(state: RendezvousState, failure: FailureRecord) -> RendezvousState | None:
    """Return the state after ``failure`` (of round ``failure.round``) is counted, or None.

    The first failure of a round counts one job restart and becomes the round's
    root cause; a later report of the same round only replaces the root cause
    when it precedes it (``FailureRecord.precedes``: not blocked behind a peer,
    or earlier), without counting again. Reports of older
    rounds, and anything after the job failed, change nothing.
    """
    if state.job_failed:
        return None
    known = _root(state)
    if known is not None and known.round > failure.round:
        return None  # a report from a round already superseded by a later failure
    s = state.copy()
    if known is not None and known.round == failure.round:
        if not failure.precedes(known):
            return None
        # an earlier failure of the same round (or one not blocked behind a peer): the real root cause
        s.failure = failure.to_dict()
        if s.blame:
            s.blame[-1] = failure.node
        return s
    s.restarts += 1  # COUNTED: one restart per failed round, whichever node saw it
    s.failure = failure.to_dict()
    s.blame = (s.blame + [failure.node])[-BLAME_KEPT:]
    return s


def fail_job(state: RendezvousState, failure: FailureRecord) -> RendezvousState | None:
    """Return the state with the job declared failed (and the rendezvous closed), or None.

    The root cause kept is the earliest failure of the latest failed round:
    ``failure``, unless the state already holds an earlier one of the same round
    (or a newer round's). None when the job was already declared failed.
    """
    if state.job_failed:
        return None
    s = state.copy()
    known = _root(state)
    if known is None or known.round < failure.round or (known.round == failure.round and failure.precedes(known)):
        s.failure = failure.to_dict()
    # OPEN -> FAILED (closed): every agent stops at its next check
    s.job_failed = True
    s.closed = True
    return s


def acknowledge_failure(state: RendezvousState, node: str) -> RendezvousState | None:
    """Return the state with ``node`` among those that saw the job's failure, or None (nothing to add)."""
    if not state.job_failed or node in state.failure_acks:
        return None
    s = state.copy()
    s.failure_acks.append(node)
    return s


def unacknowledged(state: RendezvousState, members: frozenset[str], me: str, dead: set[str]) -> list[str]:
    """Return the live nodes (sorted) that have not yet acknowledged the job's failure.

    Args:
        members: the nodes of ``me``'s last round; nodes on the wait list count too.
        dead: nodes known dead (they will never acknowledge).
    """
    nodes = (set(members) | state.wait_list) - {me} - dead - set(state.failure_acks)
    return sorted(n for n in nodes if n in state.last_heartbeats or n in state.participants)


def request_dump(state: RendezvousState, by: FailureRecord) -> RendezvousState:
    """Return the state with a new request to every agent to dump its workers' stacks."""
    s = state.copy()
    s.dump_id += 1
    s.dump_by = by.to_dict()
    s.dump_acks = []
    return s


def acknowledge_dump(state: RendezvousState, node: str, dump_id: int) -> RendezvousState | None:
    """Return the state with ``node`` among those that answered request ``dump_id``, or None."""
    if state.dump_id != dump_id or node in state.dump_acks:
        return None
    s = state.copy()
    s.dump_acks.append(node)
    return s


def dumps_pending(state: RendezvousState, dump_id: int, nodes: frozenset[str] | set[str]) -> list[str]:
    """Return the ``nodes`` (sorted) that have not answered request ``dump_id`` (all of them once superseded)."""
    if state.dump_id != dump_id:
        return []  # a newer request replaced it: nothing more to wait for
    return sorted(set(nodes) - set(state.dump_acks))


def job_state(state: RendezvousState, node: str, others: int, settings: RendezvousSettings) -> JobState:
    """Return what ``state`` says about the job, as seen by ``node`` (``others``: live peers in its round)."""
    dump_by = _record(state.dump_by)
    return JobState(
        restarts=state.restarts,
        failure=_root(state),
        failed=state.job_failed,
        dump_id=state.dump_id,
        dump_by=dump_by,
        blame=tuple(state.blame),
        node=node,
        others=others,
        min_nodes=settings.min_nodes,
        exclude_after=settings.exclude_after,
        exclude_cooldown=settings.exclude_cooldown,
    )
