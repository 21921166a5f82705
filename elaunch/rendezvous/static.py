"""Static rendezvous (``--rdzv-backend=static``, torchrun's default): fixed ranks. Stdlib only.

Mirrors torch's ``static_tcp_rendezvous``: the node rank comes from
``--node-rank`` (conf key ``rank``), the world is ``max_nodes`` and
MASTER_ADDR/MASTER_PORT are the endpoint. Before round 0 the nodes meet once at
the endpoint and learn every node's role and ``--nproc-per-node``
(``static_exchange``), so nodes may run different numbers of workers, as under
torchrun. As under torchrun, node rank 0's agent hosts the workers' store at
the endpoint (``TORCHELASTIC_USE_AGENT_STORE=True``; through ``procs.store_host``,
so the agent stays free of torch). One deliberate change: torch's store lives for
the whole job, so restarted workers read the dead workers' keys; here each round
of node rank 0 gets a fresh one.
"""

from __future__ import annotations

from elaunch.rendezvous.endpoint import parse_endpoint
from elaunch.rendezvous.local import LocalRendezvous
from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
)


#: How long the nodes wait for each other before round 0, in seconds (torch's static default).
DEFAULT_TIMEOUT = 600.0


class StaticRendezvous(LocalRendezvous):
    """Every node knows its rank and the world size up front; the nodes meet once to learn each other's size.

    Args:
        master_addr, master_port: the workers' store (the endpoint); node rank 0's
            agent listens there only until every node joined, before round 0.
        rank: this node's group rank (``--node-rank``), 0 <= rank < world_size.
        world_size: number of nodes (``--nnodes``).
        run_id: the job id.
        node: this node's role and local world size; ``addr`` "" when
            ``--local-addr`` is not given (the address node rank 0 sees is used).
        timeout: how long the nodes wait for each other before round 0, in
            seconds (``--rdzv-conf timeout``, torch's key; default 600).
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, run_id: str,
                 node: NodeInfo | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._node = node or NodeInfo("")
        self._nodes: tuple[NodeInfo, ...] = ()
        super().__init__("static", run_id)

    def next_rendezvous(self) -> RendezvousInfo:
        """Return the next round (the n-th call is round n-1).

        The first call of a job of several nodes waits until every node made its
        first call (node rank 0 listens at the endpoint, the others connect) and
        learns each node's role and local world size; later calls (restarts)
        return at once with the same nodes. With one node nothing is waited for.

        Raises:
            RendezvousClosedError: ``set_closed`` was called on this handler.
            RendezvousTimeoutError: the other nodes did not all come within ``timeout`` seconds.
            RendezvousConfigError: the nodes disagree on ``--nnodes`` or two share a ``--node-rank``.
            RendezvousConnectionError: node rank 0 cannot listen on the port, or
                something else than an elaunch agent answers there.
        """
        round_ = self._next_round()
        if not self._nodes:
            self._nodes = self._meet()
        return RendezvousInfo(
            round=round_, rank=self.rank, world_size=self.world_size,
            master_addr=self.master_addr, master_port=self.master_port, use_agent_store=True,
            host_store=self.rank == 0, nodes=self._nodes,
        )

    def _meet(self) -> tuple[NodeInfo, ...]:
        """Learn every node's NodeInfo (one exchange at the endpoint; none for one node)."""
        if self.world_size == 1:
            return (self._with_addr(self.master_addr),)
        from elaunch.rendezvous import static_exchange

        if self.rank == 0:
            listener = static_exchange.listen(self.master_port)
            return static_exchange.gather(listener, self._with_addr(self.master_addr), self.world_size, self.timeout)
        return static_exchange.join(self.master_addr, self.master_port, self._node, self.rank, self.world_size,
                                    self.timeout)

    def _with_addr(self, addr: str) -> NodeInfo:
        return self._node if self._node.addr else NodeInfo(addr, self._node.role, self._node.local_world_size)


def create_handler(params: RendezvousParameters) -> StaticRendezvous:
    """Build the static handler from ``params`` (torch ``static_tcp_rendezvous.create_rdzv_handler``).

    Raises:
        RendezvousConfigError: no ``rank`` conf (``--node-rank``), rank out of
            ``0..max_nodes-1``, no endpoint or no port in it, port 0 with more
            than one node, a ``timeout`` conf that is not a positive number of
            seconds; the message names the value.
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
    if port == 0 and params.max_nodes > 1:
        raise RendezvousConfigError(
            f"--rdzv-endpoint={params.endpoint}: port 0 with --nnodes={params.max_nodes}: the nodes of a static "
            f"job meet at a fixed port (give --master-port)")
    timeout = params.get_as_seconds("timeout", DEFAULT_TIMEOUT)
    node = NodeInfo(params.local_addr or "", params.role, params.local_world_size)
    return StaticRendezvous(host, port, rank, params.max_nodes, params.run_id, node, timeout)
