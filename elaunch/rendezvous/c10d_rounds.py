"""c10d's per-round stores: the workers' TCPStore each round's rank-0 agent hosts, and the exit barrier.

Split from ``c10d.py`` (which keeps the rendezvous backend on the agent store and
connecting to it): every round, the group-rank-0 agent hosts a NEW workers'
TCPStore (MASTER_ADDR/MASTER_PORT) and publishes its address in the round's
namespace of the agent store (see ``c10d.py`` on why torchrun's reuse of one
store is not kept). Imports torch where it makes a store: reach it only through
``elaunch.rendezvous.registry``.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from elaunch.rendezvous.c10d_agent_store import AgentStore
from elaunch.rendezvous.contract import NodeInfo
from elaunch.rendezvous.c10d_store import _GRACE, BoundedStore, StoreLine, _translated
from elaunch.rendezvous.dynamic.backend import RendezvousBackend
from elaunch.rendezvous.dynamic.handler import RoundStoreFactory, RoundStores

log = logging.getLogger("elaunch.rendezvous.c10d")  # the c10d rendezvous' one logger, as before the split


class C10dRoundStores(RoundStoreFactory):
    """Per round: a fresh workers' TCPStore on the rank-0 agent, published in the agent store.

    Args:
        agent_store: the store every agent shares and whether this agent hosts it (the host
            leaves the exit barrier last, so the others can still reach it), made now or
            in the background (``c10d_agent_store.AgentStore``).
        run_id: the job id (namespace ``elaunch/{run_id}/round/{round}/``).
        local_addr: this node's address; the workers' store is reached there.
        read_timeout: seconds for store operations (and waiting for rank 0's publication).
        use_libuv: TCPStore's libuv backend flag.
        endpoint: the agent store's address, for error messages.
        line: the agent store client's :class:`StoreLine`, shared with the backend's
            calls on it; None: one of its own.
    """

    def __init__(self, agent_store: AgentStore, run_id: str, local_addr: str, read_timeout: float,
                 use_libuv: bool, endpoint: str, line: StoreLine | None = None) -> None:
        self.agent_store = agent_store
        self._line = StoreLine() if line is None else line
        self._run_id = run_id
        self._local_addr = local_addr
        self._timeout = datetime.timedelta(seconds=read_timeout)
        self._use_libuv = use_libuv
        self._endpoint = endpoint
        self._server: Any = None

    def round_store(self, round: int) -> Any:
        """Return the agent store namespaced to ``round`` (``elaunch/{run_id}/round/{round}/``)."""
        from torch.distributed import PrefixStore

        store = PrefixStore(f"elaunch/{self._run_id}/round/{round}", self.agent_store.store)
        return BoundedStore(store, self._endpoint, self._timeout.total_seconds() + _GRACE, self._line)

    def setup_round(self, round: int, rank: int, world_size: int, nodes: tuple[NodeInfo, ...]) -> RoundStores:
        """Host (rank 0) or look up (others) the workers' store of ``round``.

        Raises:
            RendezvousConnectionError: the store cannot be created, or rank 0's
                address was not published within ``read_timeout`` seconds.
        """
        store = self.round_store(round)
        if rank == 0:
            from torch.distributed import TCPStore

            where = f"{self._local_addr}:0 (workers' store of round {round})"
            with _translated(where, "hosting"):
                server = TCPStore(self._local_addr, 0, is_master=True, multi_tenant=True,
                                  wait_for_workers=False, timeout=self._timeout, use_libuv=self._use_libuv)
            self._server = server  # created before the old one is dropped: the port differs
            addr, port = self._local_addr, int(server.port)
            with _translated(self._endpoint, f"publishing round {round}'s master address"):
                store.set("master_endpoint", f"{addr}:{port}")
                if round >= RendezvousBackend.FORGET_AFTER:  # read by that round's nodes only, long ago
                    self.round_store(round - RendezvousBackend.FORGET_AFTER).delete_key("master_endpoint")
        else:
            self._server = None  # a store hosted in an earlier round (as rank 0) is no longer used
            with _translated(self._endpoint, f"reading round {round}'s master address"):
                published = bytes(store.get("master_endpoint")).decode()
            addr, _, port_str = published.rpartition(":")
            port = int(port_str)
        return RoundStores(addr, port, True, store)

    def exit_barrier(self, round: int, rank: int, world_size: int, timeout: float) -> None:
        """Check in and wait up to ``timeout`` seconds for all ``world_size`` nodes of ``round``.

        Raises:
            RendezvousConnectionError: the agent store is unreachable.
        """
        store = self.round_store(round)
        deadline = time.monotonic() + timeout
        with _translated(self._endpoint, "the exit barrier"):
            count = store.add("exit_barrier", 1)
            while count < world_size:
                if time.monotonic() > deadline:
                    log.warning("exit barrier: %d of %d nodes of round %d arrived within %g s; leaving",
                                count, world_size, round, timeout)
                    return
                time.sleep(0.05)
                count = store.add("exit_barrier", 0)
            left = store.add("exit_barrier_left", 1)
            # the agent-store host leaves last, so no one loses the store mid-barrier
            while self.agent_store.hosting and left < world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                left = store.add("exit_barrier_left", 0)

    def close(self) -> None:
        """Drop the workers' store this node hosts (its server stops)."""
        self._server = None
