"""Applies the decisions of ``ops.py`` to a backend with compare-and-set and retry.

Mirrors torch's ``_DistributedRendezvousOpExecutor`` + ``_BackendRendezvousStateHolder``:
read the state, decide, write the implied state if the token still matches,
decide again on whatever is stored now, until the op finishes or fails.
Stdlib only; the clock and sleep are injectable for tests.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from elaunch.rendezvous.api import (
    NodeInfo,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from elaunch.rendezvous.dynamic import ops
from elaunch.rendezvous.dynamic.backend import RendezvousBackend, Token
from elaunch.rendezvous.dynamic.ops import Action, OpContext
from elaunch.rendezvous.dynamic.settings import RendezvousSettings
from elaunch.rendezvous.dynamic.state import RendezvousState

log = logging.getLogger(__name__)

Decide = Callable[[RendezvousState, OpContext, float], Action]


class OpExecutor:
    """Runs rendezvous operations for one node against one backend.

    Not thread-safe: the handler serialises calls with its own lock.

    Args:
        backend: where the state lives.
        node_id: this node's id in the state.
        node_info: this node's NodeInfo, recorded when it joins.
        settings: the rendezvous settings (poll interval, timeouts in seconds).
        clock: seconds since the epoch (default ``time.time``).
        sleep: sleeps a number of seconds (default ``time.sleep``).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        node_id: str,
        node_info: NodeInfo,
        settings: RendezvousSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._backend = backend
        self._node_id = node_id
        self._node_info = node_info
        self._settings = settings
        self._clock = clock
        self._sleep = sleep
        self._state = RendezvousState()
        self._token: Token | None = None

    @property
    def state(self) -> RendezvousState:
        """The state as last read or written by this node (may be stale)."""
        return self._state

    def read(self) -> RendezvousState:
        """Read the state from the backend and cache it.

        Raises:
            RendezvousConnectionError: the backend cannot be reached.
            RendezvousStateError: the stored state is corrupt.
        """
        data, token = self._backend.get_state()
        self._state = RendezvousState() if data is None else RendezvousState.from_bytes(data)
        self._token = token
        return self._state

    def run(self, decide: Decide, timeout: float, timeout_name: str, previous_rank: int = -1) -> RendezvousState:
        """Loop read -> ``decide`` -> compare-and-set until ``decide`` returns FINISH.

        Args:
            decide: one of the ``ops.decide_*`` functions.
            timeout: seconds the operation may take (renewed when a redundant node
                gets room in the world, as torch does).
            timeout_name: the ``--rdzv-conf`` key of ``timeout``, for error messages.
            previous_rank: this node's rank in its previous round, or -1.

        Returns:
            The state after the operation finished.

        Raises:
            RendezvousClosedError: the rendezvous is closed (ERROR_CLOSED).
            RendezvousGracefulExitError: closed while this node was redundant.
            RendezvousTimeoutError: ``timeout`` seconds passed; the message names
                ``timeout_name``, its value and the round's progress.
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        settings = self._settings
        started = self._clock()
        deadline = started + timeout
        need_read = True
        while True:
            if need_read:
                self.read()
            now = self._clock()
            ctx = OpContext(self._node_id, self._node_info, settings, deadline, previous_rank, started)
            action = decide(self._state, ctx, now)
            if action is Action.FINISH:
                return self._state
            if action is Action.ERROR_CLOSED:
                raise RendezvousClosedError(f"rendezvous {settings.run_id!r} is closed")
            if action is Action.ERROR_GRACEFUL_EXIT:
                raise RendezvousGracefulExitError(
                    f"rendezvous {settings.run_id!r} closed while this node was redundant "
                    f"(world already at max_nodes={settings.max_nodes})"
                )
            if action is Action.ERROR_TIMEOUT:
                s = self._state
                raise RendezvousTimeoutError(
                    f"rendezvous {settings.run_id!r} round {s.round}: not done within "
                    f"{timeout_name}={timeout:g} s ({len(s.participants)} node(s) joined, "
                    f"--nnodes={settings.min_nodes}:{settings.max_nodes})"
                )
            if action is Action.SYNC:
                wait_for_change = getattr(self._backend, "wait_for_change", None)
                if wait_for_change is not None:  # optional hook (etcd: a watch), bounded by poll_interval
                    wait_for_change(self._token, settings.poll_interval)
                else:
                    self._sleep(settings.poll_interval)
                need_read = True
                continue
            new_state = ops.apply(action, self._state, ctx, now)
            result = self._backend.set_state(new_state.to_bytes(), self._token)
            if result is None:
                need_read = True
                continue
            data, self._token, written = result
            self._state = RendezvousState.from_bytes(data)
            need_read = False
            log.debug("node %s: %s %s (round %d)", self._node_id, action.value,
                      "written" if written else "lost the race", self._state.round)
            if not written:
                self._sleep(random.uniform(0.0, 0.01))  # someone else wrote first: re-decide
            elif action is Action.REMOVE_FROM_REDUNDANCY_LIST:
                deadline = self._clock() + timeout  # REDUNDANT -> JOINING: fresh join deadline
