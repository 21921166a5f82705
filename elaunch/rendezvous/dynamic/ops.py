"""Decisions of the dynamic rendezvous: pure functions ``(state, ctx, now) -> Action``.

Deciding is kept apart from doing: each ``decide_*`` function looks at the shared
state and returns the next :class:`Action`; :func:`apply` returns the new state that
a write action implies. Neither touches a backend, a clock or a thread, so both are
tested with tables of cases. The executor (``executor.py``) loops
read -> decide -> apply -> compare-and-set until an op returns FINISH or an error.

The rules mirror torch's ``_RendezvousJoinOp``, ``_RendezvousExitOp`` and
``_RendezvousCloseOp`` (``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``);
torch's ``_RendezvousKeepAliveOp`` has no counterpart: a heartbeat is a write of the
node's own key (``RendezvousBackend.put_heartbeat``), not of the state. Dead-node pruning,
which torch does silently after every read, is an explicit action here; who counts
as dead or lost is judged in ``liveness.py``. All times are seconds since the epoch
(``time.time()``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.dynamic.liveness import dead_nodes
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import NodeRow, RendezvousState

#: Seconds after the join deadline during which a timed-out node still removes
#: itself from the state before raising (torch: ``rollback_period``).
ROLLBACK_PERIOD = 5.0


class Action(enum.Enum):
    """The next step of an operation, as decided from the shared state."""

    KEEP_ALIVE = "KEEP_ALIVE"  # write this node's heartbeat key (not the state)
    ADD_TO_PARTICIPANTS = "ADD_TO_PARTICIPANTS"
    ADD_TO_WAIT_LIST = "ADD_TO_WAIT_LIST"
    ADD_TO_REDUNDANCY_LIST = "ADD_TO_REDUNDANCY_LIST"
    REMOVE_FROM_PARTICIPANTS = "REMOVE_FROM_PARTICIPANTS"
    REMOVE_FROM_WAIT_LIST = "REMOVE_FROM_WAIT_LIST"
    REMOVE_FROM_REDUNDANCY_LIST = "REMOVE_FROM_REDUNDANCY_LIST"
    REMOVE_DEAD_NODES = "REMOVE_DEAD_NODES"
    PROBE = "PROBE"  # ask the complete round's participants to heart-beat now
    MARK_COMPLETE = "MARK_COMPLETE"
    MARK_CLOSED = "MARK_CLOSED"
    UPDATE_JOB = "UPDATE_JOB"  # a job-wide fact (job_ops.py): restart count, failure, stack-dump request
    SYNC = "SYNC"  # nothing to write: wait a poll interval and read again
    FINISH = "FINISH"
    ERROR_CLOSED = "ERROR_CLOSED"
    ERROR_TIMEOUT = "ERROR_TIMEOUT"
    ERROR_GRACEFUL_EXIT = "ERROR_GRACEFUL_EXIT"


#: Actions that change the shared state (the executor writes them with compare-and-set).
WRITE_ACTIONS = frozenset(
    {
        Action.ADD_TO_PARTICIPANTS,
        Action.ADD_TO_WAIT_LIST,
        Action.ADD_TO_REDUNDANCY_LIST,
        Action.REMOVE_FROM_PARTICIPANTS,
        Action.REMOVE_FROM_WAIT_LIST,
        Action.REMOVE_FROM_REDUNDANCY_LIST,
        Action.REMOVE_DEAD_NODES,
        Action.MARK_COMPLETE,
        Action.MARK_CLOSED,
        Action.PROBE,
        Action.UPDATE_JOB,
    }
)
#: Actions that end an operation with an error.
ERROR_ACTIONS = frozenset({Action.ERROR_CLOSED, Action.ERROR_TIMEOUT, Action.ERROR_GRACEFUL_EXIT})


@dataclass(frozen=True)
class OpContext:
    """Who is deciding, and until when.

    Attributes:
        node_id: this node's id in the state (unique per handler object).
        node_info: what this node declares (address, role, local world size).
        settings: the rendezvous settings.
        deadline: seconds since the epoch after which the operation times out.
        previous_rank: this node's group rank in its previous round, or -1; kept
            when the next round is ranked, if still free and in range.
        started: seconds since the epoch when the operation began (0: unknown).
    """

    node_id: str
    node_info: NodeInfo
    settings: RendezvousSettings
    deadline: float
    previous_rank: int = -1
    started: float = 0.0


def _should_keep_alive(state: RendezvousState, ctx: OpContext, now: float) -> bool:
    last = state.last_heartbeats.get(ctx.node_id)
    if last is None:
        return False
    probed = state.probe_at is not None and last < state.probe_at  # prove we are alive
    s = ctx.settings
    member = state.complete and ctx.node_id in state.participants  # judged by lost_after: beat that often
    interval = s.heartbeat_interval if member else s.keep_alive_interval
    return probed or last <= now - interval


def _should_probe(state: RendezvousState, ctx: OpContext, now: float) -> bool:
    """A waiting node probes once it waited ``probe_delay`` s, and again after each probe expired."""
    s = ctx.settings
    if not state.participants or now < ctx.started + s.probe_delay:
        return False
    return state.probe_at is None or now > state.probe_at + s.probe_timeout + s.probe_delay


def decide_join(state: RendezvousState, ctx: OpContext, now: float) -> Action:
    """Decide the next step of joining the next round (torch ``_RendezvousJoinOp``)."""
    me, settings = ctx.node_id, ctx.settings
    if state.closed:
        # JOINING -> GRACEFUL EXIT: redundant node, job is over; others -> CLOSED error
        return Action.ERROR_GRACEFUL_EXIT if me in state.redundancy_list else Action.ERROR_CLOSED
    if state.complete and me in state.participants:
        # JOINING -> JOINED. Before judging anyone dead: a member slow to read the round
        # it is in (1024 agents on 2 cores) is not pruned by another such member; a member
        # that really died is the monitors' to find (num_nodes_lost, probes).
        return Action.FINISH
    if dead_nodes(state, settings, now, exclude=me):
        return Action.REMOVE_DEAD_NODES
    n = len(state.participants)
    if me in state.redundancy_list:
        # REDUNDANT: no join timeout; wait until the world has room again
        if n >= settings.max_nodes:
            return Action.KEEP_ALIVE if _should_keep_alive(state, ctx, now) else Action.SYNC
        # REDUNDANT -> JOINING: room appeared (the executor renews the deadline)
        return Action.REMOVE_FROM_REDUNDANCY_LIST
    is_participant = me in state.participants
    if state.complete and is_participant:
        # JOINING -> JOINED
        return Action.FINISH
    if now > ctx.deadline:
        # JOINING -> TIMED OUT, after removing ourselves if there is still time
        if now <= ctx.deadline + ROLLBACK_PERIOD:
            if is_participant:
                return Action.REMOVE_FROM_PARTICIPANTS
            if me in state.wait_list:
                return Action.REMOVE_FROM_WAIT_LIST
        return Action.ERROR_TIMEOUT
    if state.complete:
        # a running round: wait for the next one (room left) or stand by (world full)
        if me not in state.wait_list:
            if n < settings.max_nodes:
                return Action.ADD_TO_WAIT_LIST
            return Action.ADD_TO_REDUNDANCY_LIST
        if _should_probe(state, ctx, now):
            # WAITING: the running round has not ended yet; are its participants alive?
            return Action.PROBE
    elif is_participant:
        # JOINING -> COMPLETE: enough participants and the last call expired
        if settings.min_nodes <= n <= settings.max_nodes and state.deadline is not None and state.deadline < now:
            return Action.MARK_COMPLETE
    else:
        return Action.ADD_TO_PARTICIPANTS
    if _should_keep_alive(state, ctx, now):
        return Action.KEEP_ALIVE
    return Action.SYNC


def decide_exit(state: RendezvousState, ctx: OpContext, now: float) -> Action:
    """Decide how to leave the current round before joining the next (torch ``_RendezvousExitOp``)."""
    if ctx.node_id in state.participants:
        if now > ctx.deadline:
            return Action.ERROR_TIMEOUT
        return Action.REMOVE_FROM_PARTICIPANTS
    return Action.FINISH


def decide_close(state: RendezvousState, ctx: OpContext, now: float) -> Action:
    """Decide how to close the rendezvous (torch ``_RendezvousCloseOp``)."""
    if state.closed:
        return Action.FINISH
    if now > ctx.deadline:
        return Action.ERROR_TIMEOUT
    return Action.MARK_CLOSED


def apply(action: Action, state: RendezvousState, ctx: OpContext, now: float) -> RendezvousState:
    """Return the state after this node performs the write ``action`` (``state`` is unchanged).

    Raises:
        ValueError: ``action`` is not one of WRITE_ACTIONS.
    """
    s = state.copy()
    me, settings = ctx.node_id, ctx.settings
    info = tuple(ctx.node_info)  # a NodeRow
    if action is Action.ADD_TO_PARTICIPANTS:
        add_participant(s, me, info, ctx.previous_rank, settings, now, writer=me)
    elif action is Action.ADD_TO_WAIT_LIST:
        # OUTSIDE -> WAITING: running groups see num_nodes_waiting() > 0
        s.redundancy_list.discard(me)
        s.wait_list.add(me)
        s.node_infos[me] = info
        s.last_heartbeats[me] = now
    elif action is Action.ADD_TO_REDUNDANCY_LIST:
        # OUTSIDE -> REDUNDANT: the world is at max_nodes
        s.redundancy_list.add(me)
        s.node_infos[me] = info
        s.last_heartbeats[me] = now
    elif action is Action.REMOVE_FROM_PARTICIPANTS:
        s.participants.pop(me, None)
        s.last_heartbeats.pop(me, None)
        after_participant_removed(s, settings)
    elif action is Action.REMOVE_FROM_WAIT_LIST:
        s.wait_list.discard(me)
        s.last_heartbeats.pop(me, None)
    elif action is Action.REMOVE_FROM_REDUNDANCY_LIST:
        s.redundancy_list.discard(me)
        s.last_heartbeats.pop(me, None)
    elif action is Action.REMOVE_DEAD_NODES:
        # ANY -> GONE: no heartbeat for keep_alive_interval * keep_alive_max_attempt
        remove_nodes(s, dead_nodes(s, settings, now, exclude=me), settings)
    elif action is Action.MARK_COMPLETE:
        _mark_complete(s, me)  # INCOMPLETE -> COMPLETE: last call expired
    elif action is Action.MARK_CLOSED:
        s.closed = True  # OPEN -> CLOSED
    elif action is Action.PROBE:
        s.probe_at = s.last_heartbeats[me] = now
    else:
        raise ValueError(f"apply({action}): not a write action")
    prune_node_infos(s)
    return s


def remove_nodes(s: RendezvousState, nodes, settings: RendezvousSettings) -> bool:
    """In place: ANY -> GONE for each of ``nodes`` (dead, or its agent found gone); True if any was there.

    Each leaves the participants, the wait, redundancy and sitting-out lists and the
    heartbeats; the next round opens when that empties a complete round. Node infos are
    pruned by :func:`apply` (or the caller: :func:`prune_node_infos`).
    """
    found = removed_participant = False
    for node in nodes:
        found |= s.last_heartbeats.pop(node, None) is not None
        in_round = s.participants.pop(node, None) is not None
        removed_participant |= in_round
        found |= in_round or node in s.wait_list or node in s.redundancy_list or node in s.sitting_out
        s.wait_list.discard(node)
        s.redundancy_list.discard(node)
        s.sitting_out.discard(node)
    if removed_participant:
        after_participant_removed(s, settings)
    return found


def prune_node_infos(s: RendezvousState) -> None:
    """In place: drop the node infos of nodes that are no longer participant, waiting or redundant."""
    members = set(s.participants) | s.wait_list | s.redundancy_list
    s.node_infos = {n: v for n, v in s.node_infos.items() if n in members}


def add_participant(s: RendezvousState, node: str, info: NodeRow, previous_rank: int,
                     settings: RendezvousSettings, now: float, heartbeat: float | None = None,
                     writer: str | None = None) -> None:
    """OUTSIDE/WAITING -> PARTICIPANT, in place (the rank is fixed when the round completes).

    ``heartbeat``: the node's last sign of life (default ``now``; ``merge.py`` adds
    nodes on their intent's time). ``writer``: the node writing this state (itself,
    or the combiner of a batched join), which gets rank 0 if this completes the round
    (see :func:`_mark_complete`).
    """
    s.wait_list.discard(node)
    s.participants[node] = previous_rank
    s.node_infos[node] = tuple(info)  # a NodeRow
    s.last_heartbeats[node] = now if heartbeat is None else heartbeat
    n = len(s.participants)
    if n == settings.min_nodes:
        # last call starts: a hard deadline, as torch's
        s.last_call_deadline = s.deadline = now + settings.last_call_timeout
    if n >= settings.min_nodes and settings.settle_timeout is not None:
        # adaptive last call: complete once no node joined for settle_timeout seconds
        hard = s.last_call_deadline if s.last_call_deadline is not None else s.deadline
        s.deadline = now + settings.settle_timeout if hard is None else min(now + settings.settle_timeout, hard)
    if n == settings.max_nodes:
        _mark_complete(s, writer)  # INCOMPLETE -> COMPLETE: world full


def after_participant_removed(s: RendezvousState, settings: RendezvousSettings) -> None:
    """In place, after participants were removed: the next round opens once a complete round is empty."""
    if s.complete:
        if not s.participants:
            # COMPLETE -> INCOMPLETE: the last participant left; the next round opens
            s.complete = False
            s.round += 1
            s.probe_at = None
    elif len(s.participants) < settings.min_nodes:
        s.deadline = s.last_call_deadline = None  # below min again: the last call is off


def _mark_complete(s: RendezvousState, writer: str | None = None) -> None:
    """Rank the participants: previous ranks kept when free and in range, then ``writer``, then the others by node id.

    ``writer`` is the node whose write completes the round; it takes rank 0 when no
    node keeps that from its previous round (in a first round, always). It holds the
    complete state already, so it can host the workers' store (c10d: rank 0 hosts it
    and publishes its port, which every other node waits for) while the others are
    still reading the state: the publication is off the round's critical path. At
    1024 simulated agents, a rank 0 that read the state late held the whole round
    up by seconds. torch ranks by node id alone; a group rank carries no meaning
    beyond the round.
    """
    s.complete = True
    s.deadline = s.last_call_deadline = None
    ids = sorted(s.participants)
    size = len(ids)
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for node in ids:
        hint = s.participants[node]
        if 0 <= hint < size and hint not in taken:
            ranks[node] = hint
            taken.add(hint)
    if writer in s.participants and writer not in ranks and 0 not in taken:
        ranks[writer] = 0
        taken.add(0)
    free = iter(r for r in range(size) if r not in taken)
    for node in ids:
        if node not in ranks:
            ranks[node] = next(free)
    s.participants = ranks
