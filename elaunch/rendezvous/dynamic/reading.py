"""Reading the shared state: the one home of every read of it (with heartbeat keys, with an intent log).

Mirrors the reading half of torch's ``_BackendRendezvousStateHolder.sync``: fetch
the stored blob and its token and decode it. Heartbeats live in per-node keys
(``RendezvousBackend.put_heartbeat``), which are read in the same round trip and
laid over the state's own record of them; where the backend keeps an intent log
(``supports_intents``) a batched join reads the round's log with it. The
executor, the batched join and the handler's monitor all read through here; the
monitor reads only its ring neighbours' heartbeat keys (:func:`read_watched`).
Stdlib only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from elaunch.rendezvous.dynamic import merge
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.state import JoinIntent, RendezvousState


def read_state(backend: RendezvousBackend, known: RendezvousState | None = None,
               fresh_after: float = float("inf")) -> tuple[RendezvousState, Token]:
    """Read the state and its token, with the nodes' heartbeat keys folded in.

    Args:
        backend: where the state lives.
        known: a state read earlier; the heartbeat keys read are those of its
            nodes (each has one), in the same round trip as the state.
        fresh_after: seconds since the epoch; a node not in ``known`` whose stored
            heartbeat is at least this recent needs no key read (see
            :func:`fold_all_heartbeats`).

    Returns:
        ``(state, token)``: an empty ``RendezvousState`` when none was written yet.

    Raises:
        RendezvousConnectionError: the backend cannot be reached.
        RendezvousStateError: the stored state is corrupt.
    """
    data, token, heartbeats = backend.get_state_and_heartbeats(_nodes(known))
    return fold_all_heartbeats(backend, _decode(data), heartbeats, fresh_after), token


def read_watched(backend: RendezvousBackend, watched: Sequence[str], members: Collection[str],
                 fresh_after: float = float("inf")) -> tuple[RendezvousState, Token]:
    """The running member's monitor read: the state with the heartbeat keys of ``watched`` only.

    ``watched`` is the node itself and its ring neighbours (``liveness.ring_neighbours``),
    so the read is of O(1) keys however large the round (c10d: one ``multi_get`` of
    the state and 3 keys). The other members keep the heartbeat stored in the state,
    as old as its last write: callers judge only ``watched``'s (``liveness.lost_members``).
    Nodes the monitor's other rules judge (``liveness.num_live_waiting``,
    ``liveness.new_nodes``) -- the wait and redundancy lists and nodes outside
    ``members`` -- get their keys read in a second round trip when their stored
    heartbeat is older than ``fresh_after`` (none while a round runs undisturbed).

    Args:
        backend: where the state lives.
        watched: the nodes whose heartbeat keys are read with the state.
        members: the nodes of the caller's running round.
        fresh_after: as in :func:`read_state`.

    Raises:
        RendezvousConnectionError: the backend cannot be reached.
        RendezvousStateError: the stored state is corrupt.
    """
    data, token, heartbeats = backend.get_state_and_heartbeats(list(watched))
    state = _decode(data)
    # a node sitting out is judged only by the node that ends the job (``job.unacknowledged``)
    judged = state.wait_list | state.redundancy_list | (set(state.last_heartbeats) - set(members) - state.sitting_out)
    missing = sorted(n for n in judged if n not in heartbeats and state.last_heartbeats.get(n, fresh_after) < fresh_after)
    if missing:
        heartbeats = {**heartbeats, **backend.get_heartbeats(missing)}
    return merge.fold_heartbeats(state, heartbeats), token


def read_state_only(backend: RendezvousBackend, known: RendezvousState) -> tuple[RendezvousState, Token]:
    """Read the state alone (1 call, no heartbeat or presence keys), with ``known``'s heartbeats folded in.

    For a node woken by its round's notice, which most likely only finishes its
    join (``ops.decide_join``: a participant of a complete round, or a closed
    rendezvous, needs no heartbeats). Its stored heartbeats can be old (they
    live in keys): the caller must not judge anyone dead on this read (read again
    with :func:`read_state` before any other decision).

    Raises:
        RendezvousConnectionError: the backend cannot be reached.
        RendezvousStateError: the stored state is corrupt.
    """
    data, token = backend.get_stored_state()
    return merge.fold_heartbeats(_decode(data), known.last_heartbeats), token


@dataclass(frozen=True)
class LogRead:
    """The state read together with one round's intent log (:func:`read_state_and_intents`).

    Attributes:
        state: the stored state, with the heartbeats of the log and the keys folded in.
        token: its compare-and-set token.
        intents: the round's log, in posting order (malformed lines skipped).
        position: the log's position (backend-defined), for ``wait_for_arrival``.
    """

    state: RendezvousState
    token: Token
    intents: list[JoinIntent]
    position: int


def read_state_and_intents(backend: RendezvousBackend, round: int, known: RendezvousState,
                           fresh_after: float = float("inf")) -> LogRead:
    """Read the state with ``round``'s intent log in one round trip (c10d: 1 store call).

    Each node's newest intent of the state's round counts as its heartbeat
    (``merge.fold_intents``); the heartbeat keys of ``known``'s nodes are read
    and folded in too, as in :func:`read_state`.

    Args:
        backend: a backend with ``supports_intents``, to whose ``round`` this node posted.
        round: the round whose log is read.
        known, fresh_after: as in :func:`read_state`.

    Raises:
        NotImplementedError: the backend keeps no intent log.
        RendezvousConnectionError: the backend cannot be reached.
        RendezvousStateError: the stored state is corrupt.
    """
    data, token, log_bytes, position, heartbeats = backend.get_state_and_intents(round, _nodes(known))
    intents = JoinIntent.parse_log(log_bytes)
    state = fold_all_heartbeats(backend, merge.fold_intents(_decode(data), intents), heartbeats, fresh_after)
    return LogRead(state, token, intents, position)


def fold_all_heartbeats(backend: RendezvousBackend, state: RendezvousState,
                        heartbeats: dict[str, float], fresh_after: float = float("inf")) -> RendezvousState:
    """Fold ``heartbeats`` into ``state``, reading the keys of its nodes not among them first.

    A node that appeared since the caller's previous read (or every node, on a
    first read) has no entry yet; its stored heartbeat can be far older than its
    key (heartbeats no longer rewrite the state), so its key is read (one more
    round trip) rather than judging it dead. Not needed when its stored
    heartbeat is at least ``fresh_after`` (callers pass now minus
    ``settings.fresh_for``: nothing that recent counts as dead or lost), as in a
    round that just completed.

    Raises:
        RendezvousConnectionError: the backend cannot be reached.
    """
    missing = sorted(n for n, t in state.last_heartbeats.items() if n not in heartbeats and t < fresh_after)
    if missing:
        heartbeats = {**heartbeats, **backend.get_heartbeats(missing)}
    return merge.fold_heartbeats(state, heartbeats)


def _decode(data: bytes | None) -> RendezvousState:
    return RendezvousState() if data is None else RendezvousState.from_bytes(data)


def _nodes(known: RendezvousState | None) -> list[str]:
    return sorted(known.last_heartbeats) if known is not None else []
