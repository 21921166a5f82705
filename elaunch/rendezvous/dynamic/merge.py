"""Batched joins, the pure part: several nodes' additions in one write, and heartbeats kept outside the state.

``combine_joins`` / ``combine_pending`` turn a round's intent log
(``state.JoinIntent``) into one new state; ``fold_intents`` / ``fold_heartbeats``
lay heartbeats kept outside the state (the log, per-node keys) over it. Like
``ops.py``, no backend, clock or thread: ``batching.py`` and ``executor.py`` do
the I/O. Stdlib only.
"""

from __future__ import annotations

from elaunch.rendezvous.dynamic import ops
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState


#: Seconds before a poster's join deadline after which the combiner no longer adds it.
#: The poster gives up at its deadline on the state it read last; a combiner's write
#: decided this long before lands before that read (or the poster finds itself added
#: and removes itself, ``ops.ROLLBACK_PERIOD``), so no one is added after giving up.
DEADLINE_MARGIN = 1.0


def combine_joins(state: RendezvousState, ctx: OpContext, intents: list[JoinIntent], now: float) -> RendezvousState:
    """ADD_TO_PARTICIPANTS for ``ctx``'s node, then for every other node whose intent may still join (pure).

    Call only when ``decide_join`` returned ADD_TO_PARTICIPANTS for ``ctx``. See
    :func:`combine_pending` for which intents are added.

    Returns:
        The new state; ``state`` is unchanged.
    """
    s = ops.apply(Action.ADD_TO_PARTICIPANTS, state, ctx, now)
    _add_intents(s, intents, ctx.settings, now, ctx.node_id)
    return s


def combine_exits(state: RendezvousState, intents: list[JoinIntent],
                  settings: RendezvousSettings) -> RendezvousState | None:
    """Return ``state`` with every leaving participant removed, or None when nobody leaves (pure).

    A participant of a complete round leaves it (to restart) by posting its join
    intent for the next round (``state.round + 1``) instead of writing its own
    REMOVE_FROM_PARTICIPANTS; the next round's combiner removes all who posted in
    one write. Such an intent needs no freshness test: a complete round takes no
    one back, so whoever posted for the next one has left this one. Once the last
    participant is gone the next round opens (``ops.after_participant_removed``);
    until then the leavers wait on the wait list with their post's time as
    heartbeat (what ADD_TO_WAIT_LIST would have written), so the members still
    running see them (``num_nodes_waiting``) and restart too.
    """
    leaving = leavers(state, intents)
    if not leaving:
        return None
    s = state.copy()
    for node in leaving:
        del s.participants[node]
        s.last_heartbeats.pop(node, None)
    ops.after_participant_removed(s, settings)
    if s.round == state.round:  # members still run: the leavers wait for the next round
        for node, intent in leaving.items():
            s.wait_list.add(node)
            s.node_infos[node] = tuple(intent.info)  # a NodeRow
            s.last_heartbeats[node] = intent.at
    ops.prune_node_infos(s)
    return s


def leavers(state: RendezvousState, intents: list[JoinIntent]) -> dict[str, JoinIntent]:
    """Return the participants of ``state``'s complete, open round that posted their exit, with their intents (pure).

    An exit is a join intent for the next round (``state.round + 1``); see
    :func:`combine_exits`. Empty while the round forms or once it is closed.
    """
    if not state.complete or state.closed:
        return {}
    return {i.node_id: i for i in intents if i.round == state.round + 1 and i.node_id in state.participants}


def combine_pending(state: RendezvousState, intents: list[JoinIntent], settings: RendezvousSettings,
                    now: float, writer: str | None = None) -> RendezvousState | None:
    """Return ``state`` with the pending intents' nodes added, or None when none may join (pure).

    A node's intent is added, in log order, while the round is open and has room,
    if the intent is for this round, at most ``settings.dead_after`` seconds old and
    at least :data:`DEADLINE_MARGIN` seconds before its node's join deadline
    (``JoinIntent.until``), and its node is not a participant or redundant already
    (a waiting node is added: it posted because the round opened). Its heartbeat is
    its newest post, the last moment it is known to be alive. Freshness keeps out a
    node that was pruned (for a heartbeat older than ``dead_after``); the deadline
    keeps out one that gave up its join: with ``join_timeout`` < ``dead_after`` its
    intent is still fresh then, and adding it would make a phantom participant,
    counted toward ``min_nodes`` until its heartbeat expired. ``writer`` (the
    combiner) gets rank 0 if this completes the round (``ops.add_participant``).
    """
    s = state.copy()
    return s if _add_intents(s, intents, settings, now, writer) else None


def _add_intents(s: RendezvousState, intents: list[JoinIntent], settings: RendezvousSettings, now: float,
                 writer: str | None) -> bool:
    newest: dict[str, float] = {}  # a node keeps alive by posting again: its last post is its heartbeat
    for intent in intents:
        newest[intent.node_id] = max(intent.at, newest.get(intent.node_id, 0.0))
    added = False
    for intent in intents:
        if s.complete or s.closed or len(s.participants) >= settings.max_nodes:
            break
        node = intent.node_id
        if (intent.round != s.round or node in s.participants or node in s.redundancy_list
                or not now - settings.dead_after <= intent.at <= now + settings.dead_after
                or now > intent.until - DEADLINE_MARGIN):
            continue
        ops.add_participant(s, intent.node_id, intent.info, intent.previous_rank, settings, now,
                         heartbeat=min(newest[intent.node_id], now), writer=writer)
        added = True
    if added:
        ops.prune_node_infos(s)
    return added


def fold_intents(state: RendezvousState, intents: list[JoinIntent]) -> RendezvousState:
    """Return ``state`` with each present node's heartbeat raised to its newest intent of this round (pure).

    A node that posted an intent was alive when it posted. Returns ``state``
    itself when nothing changes.
    """
    return fold_heartbeats(state, {i.node_id: i.at for i in intents if i.round == state.round})


def fold_heartbeats(state: RendezvousState, heartbeats: dict[str, float]) -> RendezvousState:
    """Return ``state`` with each present node's heartbeat raised to ``heartbeats[node]`` when newer (pure).

    Used for heartbeats kept outside the state (per-node keys, the intent log):
    readers judge liveness on the newer of the two, and the next write stores it.
    Nodes not in ``last_heartbeats`` (never added, left, pruned) are not touched.
    Returns ``state`` itself when nothing changes.
    """
    raised = {n: t for n, t in heartbeats.items()
              if n in state.last_heartbeats and t > state.last_heartbeats[n]}
    if not raised:
        return state
    s = state.copy()
    s.last_heartbeats.update(raised)
    return s
