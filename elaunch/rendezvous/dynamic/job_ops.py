"""Job-wide facts in the rendezvous state: restart count, failure verdict, stack-dump requests.

Pure functions ``(state, ...) -> new state or None`` (None: nothing to write),
applied by the executor with compare-and-set like the ops of ``ops.py``. They
carry what one agent learns that the whole job must act on, so every agent sees
it in the state its monitor already reads (torch keeps none of this: each
agent counts its own restarts and a failed node's peers never hear of it).
Stdlib only.
"""

from __future__ import annotations

from elaunch.rendezvous.contract import FailureRecord, JobState, RendezvousStateError
from elaunch.rendezvous.dynamic import ops
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


def note_failure(state: RendezvousState, failure: FailureRecord,
                 probe_at: float | None = None) -> RendezvousState | None:
    """Return the state with ``failure`` (of round ``failure.round``) reported, not yet counted; or None.

    The first report of a round becomes its root cause, uncounted
    (``count_round`` counts it once the reporter saw every member alive); a later
    report of the same round adds its node to ``reported`` and replaces the root
    cause only when it precedes it (``FailureRecord.precedes``: not blocked behind
    a peer, or earlier). Reports of older rounds, and anything after the job
    failed, change nothing.

    Args:
        probe_at: when given (seconds since the epoch), also asks every agent to
            heart-beat at once (``state.probe_at``, see ``liveness.dead_nodes``): the
            reporter waits for that answer before it counts the failure.
    """
    if state.job_failed:
        return None
    known = _root(state)
    if known is not None and known.round > failure.round:
        return None  # a report from a round already superseded by a later failure
    s = state.copy()
    if probe_at is not None and (s.probe_at is None or s.probe_at < probe_at):
        s.probe_at = probe_at
    if known is None or known.round < failure.round:
        s.failure, s.counted, s.reported = failure.to_dict(), False, [failure.node]
        return s
    if failure.node not in s.reported:
        s.reported.append(failure.node)
    if failure.precedes(known):
        # an earlier failure of the same round (or one not blocked behind a peer): the real root cause
        s.failure = failure.to_dict()
        if s.counted and s.blame:
            s.blame[-1] = failure.node
    return None if s == state else s


def count_round(state: RendezvousState, round: int) -> RendezvousState | None:
    """Return the state with ``round``'s reported failure counted as one job restart, or None.

    None when it was counted already (whichever node counted it), when ``round``
    is not the latest failed round, or when the job failed.
    """
    known = _root(state)
    if state.job_failed or known is None or known.round != round or state.counted:
        return None
    s = state.copy()
    s.restarts += 1  # COUNTED: one restart per failed round, whichever node saw it
    s.counted = True
    s.blame = (s.blame + [known.node])[-BLAME_KEPT:]
    return s


def count_failure(state: RendezvousState, failure: FailureRecord) -> RendezvousState | None:
    """Return the state after ``failure`` is reported and its round counted (``note_failure`` + ``count_round``), or None."""
    noted = note_failure(state, failure)
    counted = count_round(noted if noted is not None else state, failure.round)
    return counted if counted is not None else noted


def answers(state: RendezvousState, round: int, nodes: frozenset[str] | set[str], since: float,
            dead: set[str]) -> tuple[set[str], set[str]]:
    """Return ``(alive, lost)`` among ``nodes``, the other members of ``round``, after its failure at ``since``.

    Alive: the node reported ``round``'s failure itself, saw the job's failure,
    waits for the next round or joined it, or heart-beat at or after ``since``
    (seconds since the epoch). Lost: it left ``round`` (a leave, or pruned), or is
    ``dead`` (``liveness.dead_nodes``: it did not answer the probe). The rest have not
    answered yet.
    """
    known = _root(state)
    reported = set(state.reported) if known is not None and known.round == round else set()
    newer = set(state.participants) if state.round > round else set()
    alive, lost = set(), set()
    for n in nodes:
        if (n in reported or n in state.wait_list or n in newer or n in state.failure_acks
                or state.last_heartbeats.get(n, float("-inf")) >= since):
            alive.add(n)
        elif n in dead or (state.round == round and n not in state.participants):
            lost.add(n)
    return alive, lost


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


def succeed_job(state: RendezvousState) -> RendezvousState | None:
    """Return the state with the job declared succeeded (and the rendezvous closed), or None.

    None when the job already failed or succeeded: a verdict is never replaced.
    """
    if state.job_failed or state.job_succeeded:
        return None
    s = state.copy()
    # OPEN -> SUCCEEDED (closed): waiting, spare and sitting-out nodes exit 0 when they see it
    s.job_succeeded = True
    s.closed = True
    return s


def sit_out(state: RendezvousState, node: str, now: float, settings: RendezvousSettings) -> RendezvousState | None:
    """Return the state with ``node`` out of its round and the lists, sitting out and watching; or None.

    ``node`` keeps a heartbeat (``now``, then its own beats), so the node that ends
    the job can tell a live watcher from a dead one. None when it sits out already.
    """
    if node in state.sitting_out and node not in state.participants:
        return None
    s = state.copy()
    s.participants.pop(node, None)
    s.wait_list.discard(node)
    s.redundancy_list.discard(node)
    s.node_infos.pop(node, None)
    s.sitting_out.add(node)
    s.last_heartbeats[node] = now
    ops.after_participant_removed(s, settings)
    return s


def unacknowledged(state: RendezvousState, members: frozenset[str], me: str, dead: set[str]) -> list[str]:
    """Return the live nodes (sorted) that have not yet seen the end of the job ``me`` declared.

    After a failure: the members of ``me``'s last round, and the waiting, spare and
    sitting-out nodes, that did not acknowledge it. After a success: the waiting,
    spare and sitting-out nodes still in the state (the members passed the exit
    barrier; a watcher that sees the success leaves the state).

    Args:
        members: the nodes of ``me``'s last round.
        dead: nodes known dead (they will never acknowledge).
    """
    watchers = state.wait_list | state.redundancy_list | state.sitting_out
    nodes = (watchers if state.job_succeeded else set(members) | watchers) - {me} - dead - set(state.failure_acks)
    return sorted(n for n in nodes if n in state.last_heartbeats or n in state.participants)


def request_dump(state: RendezvousState, by: FailureRecord | None) -> RendezvousState:
    """Return the state with a new request to every agent to dump its workers' stacks.

    Args:
        by: the hung worker behind the request; None for a request of a person
            (``elaunch status --stacks``): no hang, and agents stop nothing for it.
    """
    s = state.copy()
    s.dump_id += 1
    s.dump_by = None if by is None else by.to_dict()
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
        succeeded=state.job_succeeded,
        closed=state.closed,
        dump_id=state.dump_id,
        dump_by=dump_by,
        blame=tuple(state.blame),
        node=node,
        others=others,
        min_nodes=settings.min_nodes,
        exclude_after=settings.exclude_after,
        exclude_cooldown=settings.exclude_cooldown,
    )
