"""Timing and size knobs of a dynamic rendezvous, read from ``--rdzv-conf``.

Mirrors torch's ``RendezvousSettings`` / ``RendezvousTimeout`` and the conf keys
its ``create_handler`` reads; every duration is in seconds. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from elaunch.rendezvous.contract import RendezvousConfigError, RendezvousParameters

#: Seconds without a new node after which a round with ``min_nodes`` completes.
DEFAULT_SETTLE_TIMEOUT = 1.0
#: Seconds a running round's member may go without a heartbeat before it counts as lost
#: (conf ``lost_after``), unless ``keep_alive_interval``/``keep_alive_max_attempt`` are given.
#: Above a 2 s freeze (SIGSTOP, a stalled VM) plus one heartbeat interval, so such a node
#: is not thrown out; low enough that a cut link re-forms the survivors within 5 s.
DEFAULT_LOST_AFTER = 3.0
#: Heartbeats per ``lost_after`` of a running round's member: its largest possible lag
#: without a freeze is ``lost_after / HEARTBEATS_PER_LOST_AFTER``.
HEARTBEATS_PER_LOST_AFTER = 8


@dataclass(frozen=True)
class RendezvousSettings:
    """How a dynamic rendezvous behaves.

    Attributes:
        run_id: the job id; nodes with different ids never meet.
        min_nodes, max_nodes: bounds on a round's world, 1 <= min <= max.
        join_timeout: seconds a ``next_rendezvous`` call may take (conf ``join_timeout``, 600).
        last_call_timeout: seconds to wait for more nodes once ``min_nodes`` joined
            (conf ``last_call_timeout``, 30). A hard deadline: the round completes
            when it passes, whatever ``settle_timeout`` says.
        settle_timeout: the adaptive last call (an elaunch addition), seconds, or None
            for torch's fixed last call. Once ``min_nodes`` joined, the round completes
            as soon as no node joined for this long (still at the latest after
            ``last_call_timeout``). Conf ``settle_timeout``; default 1 s, except None
            when ``last_call_timeout`` is given without ``settle_timeout``, so an
            explicit ``last_call_timeout`` keeps torch's meaning.
        close_timeout: seconds ``set_closed`` may take (conf ``close_timeout``, 30).
        heartbeat_timeout: seconds one keep-alive write may take (conf ``heartbeat_timeout``, 5).
        keep_alive_interval: seconds between a node's heartbeats (conf ``keep_alive_interval``, 5).
        keep_alive_max_attempt: heartbeats a node may miss before it is declared dead
            and removed (conf ``keep_alive_max_attempt``, 3). Torch's rule, ``dead_after``
            = the two multiplied (15 s), still judges joining and waiting nodes.
        lost_after: seconds a member of a complete (running) round may go without a
            heartbeat before it counts as lost: its peers re-form without it, and a
            joining node prunes it (conf ``lost_after``, an elaunch addition). None
            means ``dead_after``. ``from_params`` sets 3 s (:data:`DEFAULT_LOST_AFTER`)
            unless ``keep_alive_interval`` or ``keep_alive_max_attempt`` is given, so an
            explicit torch key keeps torch's meaning. Running members heart-beat every
            ``heartbeat_interval`` seconds from a thread of their own.
        poll_interval: seconds between reads of the state while waiting for others
            (conf ``poll_interval``, 0.2; torch polls every 1 s).
        probe_delay: seconds a node waits for the next round while the current one
            still has participants before it probes them (conf ``probe_delay``, 1).
        probe_timeout: seconds a probed participant has to heart-beat before it is
            declared dead (conf ``probe_timeout``, 3); live agents answer within about
            ``probe_timeout / 4``. An elaunch addition: torch only has the
            ``keep_alive_interval * keep_alive_max_attempt`` rule, which still applies.
        exclude_after: a node whose workers are the root cause of this many counted
            failures in a row sits out the next rounds (conf ``exclude_after``, 2;
            0 = never), when the others still meet ``min_nodes``. An elaunch addition.
        exclude_cooldown: seconds such a node sits out before it rejoins (conf
            ``exclude_cooldown``, 600).
        presence: whether each running member listens on a presence port, so that its
            neighbours find it lost at once, by a refused connection, when its agent is
            killed while its host stays up (``presence.py``; conf ``presence``, true).
            An elaunch addition.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    settle_timeout: float | None = DEFAULT_SETTLE_TIMEOUT
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    lost_after: float | None = None
    poll_interval: float = 0.2
    probe_delay: float = 1.0
    probe_timeout: float = 3.0
    exclude_after: int = 2
    exclude_cooldown: float = 600.0
    presence: bool = True

    def __post_init__(self) -> None:
        if not self.run_id:
            raise RendezvousConfigError("--rdzv-id='': the run id must not be empty")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise RendezvousConfigError(
                f"--nnodes={self.min_nodes}:{self.max_nodes}: need 1 <= MIN ({self.min_nodes}) <= MAX ({self.max_nodes})"
            )
        if self.exclude_after < 0:
            raise RendezvousConfigError(f"--rdzv-conf exclude_after={self.exclude_after}: must be >= 0 (0 = never)")
        if self.keep_alive_max_attempt < 1:
            raise RendezvousConfigError(
                f"--rdzv-conf keep_alive_max_attempt={self.keep_alive_max_attempt}: must be >= 1"
            )

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a joining or waiting node counts as dead (torch's rule)."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def member_lost_after(self) -> float:
        """Seconds without a heartbeat after which a running round's member counts as lost (``lost_after``)."""
        return self.dead_after if self.lost_after is None else self.lost_after

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between a running member's heartbeats: ``lost_after / 8``, at most ``keep_alive_interval``.

        With the defaults 0.375 s: a member frozen for F seconds lags at most
        F + 0.375 s, so a 2 s freeze stays 0.6 s clear of ``lost_after`` (3 s).
        Under torch's rule (``lost_after`` None) torch's ``keep_alive_interval``.
        """
        if self.lost_after is None:
            return self.keep_alive_interval
        return min(self.keep_alive_interval, self.lost_after / HEARTBEATS_PER_LOST_AFTER)

    @property
    def fresh_for(self) -> float:
        """Seconds a stored heartbeat is recent enough that no rule judges its node dead or lost.

        A read may skip a node's heartbeat key when its stored heartbeat is this recent
        (``reading.fold_all_heartbeats``): ``min(keep_alive_interval, member_lost_after)``.
        """
        return min(self.keep_alive_interval, self.member_lost_after)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousSettings:
        """Read the settings from ``params`` and its ``--rdzv-conf`` keys.

        ``lost_after`` is :data:`DEFAULT_LOST_AFTER` when neither it nor a torch
        keep-alive key is given (on every backend).

        Raises:
            RendezvousConfigError: a value is not a positive number, or the node
                bounds are inconsistent; the message names the key and value.
        """
        d = cls.__dataclass_fields__
        lost_after: float | None = DEFAULT_LOST_AFTER
        if params.get("lost_after") is not None:
            lost_after = params.get_as_seconds("lost_after", DEFAULT_LOST_AFTER)
        elif params.get("keep_alive_interval") is not None or params.get("keep_alive_max_attempt") is not None:
            lost_after = None  # torch's keys given: its rule (interval x attempts) judges members too
        attempts = params.get_as_int("keep_alive_max_attempt", d["keep_alive_max_attempt"].default)
        settle: float | None = d["settle_timeout"].default
        if params.get("settle_timeout") is not None:
            settle = params.get_as_seconds("settle_timeout", DEFAULT_SETTLE_TIMEOUT)
        elif params.get("last_call_timeout") is not None:
            settle = None  # an explicit last call is torch's fixed deadline
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_timeout=params.get_as_seconds("join_timeout", d["join_timeout"].default),
            last_call_timeout=params.get_as_seconds("last_call_timeout", d["last_call_timeout"].default),
            settle_timeout=settle,
            close_timeout=params.get_as_seconds("close_timeout", d["close_timeout"].default),
            heartbeat_timeout=params.get_as_seconds("heartbeat_timeout", d["heartbeat_timeout"].default),
            keep_alive_interval=params.get_as_seconds("keep_alive_interval", d["keep_alive_interval"].default),
            keep_alive_max_attempt=attempts,
            lost_after=lost_after,
            poll_interval=params.get_as_seconds("poll_interval", d["poll_interval"].default),
            probe_delay=params.get_as_seconds("probe_delay", d["probe_delay"].default),
            probe_timeout=params.get_as_seconds("probe_timeout", d["probe_timeout"].default),
            exclude_after=params.get_as_int("exclude_after", d["exclude_after"].default),
            exclude_cooldown=params.get_as_seconds("exclude_cooldown", d["exclude_cooldown"].default),
            presence=params.get_as_bool("presence", d["presence"].default),
        )
