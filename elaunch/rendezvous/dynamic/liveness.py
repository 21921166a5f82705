"""Who is alive in the dynamic rendezvous' state: pure judgements of heartbeats and membership.

Dead nodes (pruned by joiners, not waited for), the live waiting count
(``num_nodes_waiting``), the ring of neighbours a running member watches, and
the running round's lost and new members (the job channel's
``num_nodes_lost``/``num_nodes_new``). Pure functions of the state, tested as
tables; the decisions that act on them are in ``ops.py``. All times are seconds
since the epoch (``time.time()``). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Collection

from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState


def dead_nodes(state: RendezvousState, settings: RendezvousSettings, now: float, exclude: str = "",
               members: Collection[str] = ()) -> list[str]:
    """Return the ids (sorted) of the nodes that count as dead.

    Dead: the last heartbeat is older than ``settings.dead_after`` seconds (torch's
    rule), or older than a probe (``state.probe_at``) that is more than
    ``settings.probe_timeout`` seconds old: every live agent answers a probe at once.
    A participant of a complete round (its agent runs a keep-alive thread, beating
    every ``settings.heartbeat_interval`` s) is dead after ``settings.member_lost_after``
    seconds already (``lost_after``, 3 s by default), as :func:`lost_members` judges it;
    so are ``members``, the nodes of a round the caller knows ran (complete), even once
    the state moved on to a next round that is not complete yet (another member
    re-formed after it found one of them lost).
    """
    expire = now - settings.dead_after
    if state.probe_at is not None and now > state.probe_at + settings.probe_timeout:
        expire = max(expire, state.probe_at)
    member_expire = max(expire, now - settings.member_lost_after)
    running = set(members) | (set(state.participants) if state.complete else set())
    return sorted(n for n, t in state.last_heartbeats.items()
                  if n != exclude and t < (member_expire if n in running else expire))


def num_live_waiting(state: RendezvousState, settings: RendezvousSettings, now: float) -> int:
    """Return how many nodes on the wait list still heart-beat (dead ones do not count)."""
    dead = set(dead_nodes(state, settings, now))
    return sum(1 for n in state.wait_list if n not in dead)


def should_answer_probe(state: RendezvousState, node_id: str) -> bool:
    """Return True when ``node_id`` has a heartbeat older than the state's probe."""
    last = state.last_heartbeats.get(node_id)
    return last is not None and state.probe_at is not None and last < state.probe_at


def new_nodes(state: RendezvousState, round: int, members: frozenset[str], settings: RendezvousSettings,
              now: float) -> int:
    """Return how many live nodes outside ``me``'s running round joined since it formed (pure).

    Counted: nodes on the wait list, and the participants of a newer round, that
    were not members of ``round``. A member that left to rejoin (after its own
    workers failed) is not new; a node that is dead (``dead_nodes``) does not count.
    A closed rendezvous has no new nodes.

    Args:
        state: the stored state.
        round: the round ``me`` joined; members: its participants then.
        now: seconds since the epoch, for the dead-node rule.
    """
    if state.closed or not members or state.round < round:
        return 0
    joining = set(state.wait_list)
    if state.round > round:
        joining |= set(state.participants)
    dead = set(dead_nodes(state, settings, now))
    return sum(1 for n in joining - members if n not in dead)


#: Members after it in its round's sorted member list whose heartbeats a running member judges.
WATCHED_NEIGHBOURS = 2


def ring_neighbours(members: frozenset[str] | set[str], me: str, count: int = WATCHED_NEIGHBOURS) -> tuple[str, ...]:
    """Return the ``count`` members after ``me`` in sorted order, wrapping around (pure).

    Each running member judges the heartbeats of these only, so its monitor reads
    O(1) keys however large the round: every member is judged by the ``count``
    members before it, and a node that finds one lost re-forms, which every other
    member sees in the state (it leaves the participants; the round is superseded).
    Fewer in a smaller round (2 nodes: the other; 3: both others); none when ``me``
    is alone or not a member.
    """
    ring = sorted(members)
    if me not in ring:
        return ()
    i = ring.index(me)
    return tuple(ring[(i + k) % len(ring)] for k in range(1, min(count, len(ring) - 1) + 1))


def lost_members(state: RendezvousState, round: int, members: frozenset[str], me: str,
                 settings: RendezvousSettings, watched: tuple[str, ...] | None = None,
                 stalled_until: float = 0.0) -> int:
    """Return how many nodes of ``me``'s running round are gone (pure).

    A member is gone when it left the participants (it is rejoining, or was pruned),
    when the round was superseded (a state of an older round is stale, not a loss),
    or, if it is ``watched``, when its silence lags ``me``'s own heartbeat by more
    than ``settings.member_lost_after`` seconds (``lost_after``, 3 s by default).
    Its silence counts from the later of its last heartbeat and ``stalled_until``,
    the end of ``me``'s own last store stall (``stalls.StoreStalls``): time the
    store did not answer ``me`` (an etcd leader election, a frozen leader) counts
    against no node. Measuring the lag against our own heartbeat (not the clock)
    means an outage of the backend, after which every heartbeat is old, does not
    make everyone look dead. A closed rendezvous (the job is ending) loses nobody.

    Args:
        state: the stored state.
        round: the round ``me`` joined; members: its participants then.
        watched: the members whose heartbeats ``state`` holds fresh (the monitor
            reads only ``ring_neighbours``' keys); None: every member's. The
            others' stored heartbeats may be as old as the round: never judged.
        stalled_until: seconds since the epoch when ``me``'s last store stall ended (0: none).
    """
    if state.closed or not members:
        return 0
    if state.round < round:
        return 0  # a read from before our round completed: nothing to judge yet
    if state.round > round:
        return max(1, len(members - {me} - set(state.participants)))
    return _gone(state, members, me, settings, watched, stalled_until, state.participants)


def members_left(state: RendezvousState, round: int, members: frozenset[str], me: str,
                 settings: RendezvousSettings, watched: tuple[str, ...] | None = None,
                 stalled_until: float = 0.0) -> int:
    """Return how many of ``me``'s round's other members have left the rendezvous (pure).

    As :func:`lost_members`, except that a member still in the rendezvous is not counted:
    one that left the round to rejoin (it waits on the wait or redundancy list, or is a
    participant of a newer round) is lost for the round, which must restart, but it has
    not left the job. What a node waiting for its next round says of the job's size
    (``only N of the job's nodes are left``) counts these; counting a rejoining member
    as gone made that line appear, falsely, at a worker failure while every node lived.
    """
    if state.closed or not members or state.round < round:
        return 0
    present = set(state.participants) | set(state.wait_list) | set(state.redundancy_list)
    return _gone(state, members, me, settings, watched, stalled_until, present)


def _gone(state: RendezvousState, members: frozenset[str], me: str, settings: RendezvousSettings,
          watched: tuple[str, ...] | None, stalled_until: float, present: Collection[str]) -> int:
    """Members other than ``me`` not in ``present``, or watched and silent for longer than ``member_lost_after``."""
    mine = state.last_heartbeats.get(me)
    gone = 0
    judged = members if watched is None else frozenset(watched)
    for node in members - {me}:
        if node not in present:
            gone += 1
        elif (node in judged and mine is not None
              and mine - _silent_since(state, node, stalled_until) > settings.member_lost_after):
            gone += 1
    return gone


def _silent_since(state: RendezvousState, node: str, stalled_until: float) -> float:
    """When ``node``'s silence began for the observer: its last beat, or the observer's stall's end if later.

    A node with no heartbeat (none read, or 0: etcd-v3 found its presence lease gone)
    gets no grace: it is not silent, it is gone.
    """
    last = state.last_heartbeats.get(node, 0.0)
    return max(last, stalled_until) if last > 0 else 0.0
