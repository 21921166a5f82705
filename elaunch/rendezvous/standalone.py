"""Single-node rendezvous (``--standalone``): no rendezvous store, no other node. Stdlib only.

torchrun implements ``--standalone`` as a c10d rendezvous on ``localhost:0``
whose agent hosts the workers' store. elaunch needs no rendezvous store for one
node; its agent hosts the workers' store as torchrun's does
(``TORCHELASTIC_USE_AGENT_STORE=True``, through ``procs.store_host``), on a fresh
free loopback port every round, so a restart never reads what the previous
workers wrote.
"""

from __future__ import annotations

import socket

from elaunch.rendezvous.local import LocalRendezvous
from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
)

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK, avoid: int | None = None) -> int:
    """Return a TCP port on ``host`` that is free right now (not ``avoid`` if possible).

    Raises:
        RendezvousConnectionError: no socket could be bound on ``host``.
    """
    port = avoid
    for _ in range(8):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        except OSError as exc:
            raise RendezvousConnectionError(f"cannot bind a free port on {host}: {exc}") from exc
        if port != avoid:
            break
    assert port is not None
    return port


class StandaloneRendezvous(LocalRendezvous):
    """Rendezvous of one node with itself.

    Args:
        run_id: the job id.
        node: this node's NodeInfo.
    """

    def __init__(self, run_id: str, node: NodeInfo) -> None:
        super().__init__("standalone", run_id)
        self._node = node

    def next_rendezvous(self) -> RendezvousInfo:
        """Return round ``n`` (the n-th call, 0-based): rank 0 of 1, the agent hosting the store on a fresh port.

        ``master_port`` is 0: the agent binds a free loopback port for the round's store.

        Raises:
            RendezvousClosedError: ``set_closed`` was called.
        """
        return RendezvousInfo(
            round=self._next_round(), rank=0, world_size=1, master_addr=LOOPBACK, master_port=0,
            use_agent_store=True, host_store=True, nodes=(self._node,),
        )



def create_handler(params: RendezvousParameters) -> StandaloneRendezvous:
    """Build the standalone handler; ``params.endpoint`` and the node bounds are ignored."""
    node = NodeInfo(params.local_addr or LOOPBACK, params.role, params.local_world_size)
    return StandaloneRendezvous(params.run_id, node)
