"""Rank assignment: a pure function of the completed round.

torch's agent assigns ranks with extra store round trips (every agent writes its
role info, rank 0 computes and writes back). elaunch's rendezvous already carries
each node's role and local world size (``RendezvousInfo.nodes``), so every agent
computes the same answer locally with no store traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

from elaunch.rendezvous.contract import NodeInfo
from elaunch.spec import Worker


def assign_ranks(
    nodes: Sequence[NodeInfo],
    group_rank: int,
    group_world_size: int,
    role: str,
    local_world_size: int,
) -> list[Worker]:
    """Return this node's workers with global and role ranks filled in.

    Global ranks are contiguous per node, in group-rank order: node ``g`` gets
    ``[sum(lws of nodes < g), ... + lws_g)``. Role ranks are the same
    cumulative sum taken over the nodes of the same role only. This is the
    assignment torch's ``SimpleElasticAgent._assign_worker_ranks`` produces.

    Args:
        nodes: every node of the round in group-rank order (every elaunch
            backend gives them; static learns them when its nodes first meet), or
            empty when a backend does not know them; then all ``group_world_size``
            nodes are assumed to run ``role`` with ``local_world_size`` workers
            (torch's ``TORCH_ELASTIC_WORKER_IDENTICAL=1`` fast path).
        group_rank: this node's rank, 0 <= group_rank < group_world_size.
        group_world_size: number of nodes in the round.
        role: this node's role.
        local_world_size: this node's number of workers (>= 1).

    Returns:
        ``local_world_size`` Workers, in local-rank order, without pids.

    Raises:
        ValueError: ``nodes`` is given but disagrees with ``group_world_size``,
            ``group_rank`` or this node's own role and size.
    """
    if not nodes:
        nodes = [NodeInfo("", role, local_world_size)] * group_world_size
    if len(nodes) != group_world_size or not 0 <= group_rank < group_world_size:
        raise ValueError(
            f"rendezvous returned {len(nodes)} nodes for world size {group_world_size}, group rank {group_rank}"
        )
    me = nodes[group_rank]
    if me.role != role or me.local_world_size != local_world_size:
        raise ValueError(
            f"rendezvous lists this node as role={me.role!r} nproc={me.local_world_size}, "
            f"expected role={role!r} nproc={local_world_size}"
        )
    before = nodes[:group_rank]
    base_global = sum(n.local_world_size for n in before)
    base_role = sum(n.local_world_size for n in before if n.role == role)
    world_size = sum(n.local_world_size for n in nodes)
    role_world_size = sum(n.local_world_size for n in nodes if n.role == role)
    return [
        Worker(
            local_rank=lr,
            global_rank=base_global + lr,
            role_rank=base_role + lr,
            world_size=world_size,
            role_world_size=role_world_size,
        )
        for lr in range(local_world_size)
    ]
