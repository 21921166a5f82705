"""Single-node rendezvous (``--standalone``): no store, no other node. Stdlib only.

torchrun implements ``--standalone`` as a c10d rendezvous on ``localhost:0``;
elaunch needs no agent store for one node: worker rank 0 hosts the workers'
store on a fresh free loopback port every round, so a restart never reads what
the previous workers wrote.
"""

from __future__ import annotations

import socket

from elaunch.rendezvous.local import LocalRendezvous
from elaunch.rendezvous.api import (
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
        self._port: int | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """Return round ``n`` (the n-th call, 0-based): rank 0 of 1, a fresh loopback MASTER_PORT.

        Raises:
            RendezvousClosedError: ``set_closed`` was called.
            RendezvousConnectionError: no loopback port could be bound.
        """
        round_ = self._next_round()
        self._port = free_port(LOOPBACK, avoid=self._port)
        return RendezvousInfo(
            round=round_, rank=0, world_size=1, master_addr=LOOPBACK, master_port=self._port,
            use_agent_store=False, nodes=(self._node,),
        )



def create_handler(params: RendezvousParameters) -> StandaloneRendezvous:
    """Build the standalone handler; ``params.endpoint`` and the node bounds are ignored."""
    node = NodeInfo(params.local_addr or LOOPBACK, params.role, params.local_world_size)
    return StandaloneRendezvous(params.run_id, node)
