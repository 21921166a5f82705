"""Static rendezvous (``--rdzv-backend=static``, torchrun's default): fixed ranks. Stdlib only.

Mirrors torch's ``static_tcp_rendezvous``: the node rank comes from
``--node-rank`` (conf key ``rank``), the world is ``max_nodes`` and
MASTER_ADDR/MASTER_PORT are the endpoint. One deliberate change: torch's agent
on node rank 0 hosts a TCPStore at the endpoint that lives for the whole job,
so restarted workers read the dead workers' keys; here no agent hosts it
(``use_agent_store=False``), worker rank 0 hosts a new one each round.
"""

from __future__ import annotations

from elaunch.rendezvous.endpoint import parse_endpoint
from elaunch.rendezvous.local import LocalRendezvous
from elaunch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
)


class StaticRendezvous(LocalRendezvous):
    """Every node knows its rank and the world size up front.

    Args:
        master_addr, master_port: the workers' store (the endpoint).
        rank: this node's group rank (``--node-rank``), 0 <= rank < world_size.
        world_size: number of nodes (``--nnodes``).
        run_id: the job id.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, run_id: str) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        super().__init__("static", run_id)

    def next_rendezvous(self) -> RendezvousInfo:
        """Return the next round (the n-th call is round n-1) at once: nothing to wait for.

        Raises:
            RendezvousClosedError: ``set_closed`` was called on this handler.
        """
        return RendezvousInfo(
            round=self._next_round(), rank=self.rank, world_size=self.world_size,
            master_addr=self.master_addr, master_port=self.master_port, use_agent_store=False, nodes=(),
        )



def create_handler(params: RendezvousParameters) -> StaticRendezvous:
    """Build the static handler from ``params`` (torch ``static_tcp_rendezvous.create_rdzv_handler``).

    Raises:
        RendezvousConfigError: no ``rank`` conf (``--node-rank``), rank out of
            ``0..max_nodes-1``, no endpoint or no port in it; the message names the value.
    """
    raw_rank = params.get("rank")
    if raw_rank is None:
        raise RendezvousConfigError("static rendezvous: no node rank given (add --node-rank)")
    rank = params.get_as_int("rank")
    assert rank is not None
    if not 0 <= rank < params.max_nodes:
        raise RendezvousConfigError(f"--node-rank={rank}: must be in 0..{params.max_nodes - 1} for --nnodes={params.max_nodes}")
    if not params.endpoint.strip():
        raise RendezvousConfigError("static rendezvous: no endpoint (add --master-addr and --master-port)")
    host, port = parse_endpoint(params.endpoint, allow_zero=True, bare_ipv6=True)
    if port is None:
        raise RendezvousConfigError(f"--rdzv-endpoint={params.endpoint}: no port (add --master-port)")
    return StaticRendezvous(host, port, rank, params.max_nodes, params.run_id)
