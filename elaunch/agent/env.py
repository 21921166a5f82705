"""The environment each worker starts with: exactly the variables torchrun sets.

Mirrors ``LocalElasticAgent._start_workers`` and ``_set_local_rank_env`` in
``torch.distributed.elastic.agent.server.local_elastic_agent``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elaunch.spec import Worker, WorkerGroup


@dataclass(frozen=True)
class EnvOptions:
    """Per-job inputs of the worker environment that are not in the WorkerGroup.

    Attributes:
        run_id: ``TORCHELASTIC_RUN_ID``.
        max_restarts: ``TORCHELASTIC_MAX_RESTARTS``.
        use_agent_store: ``TORCHELASTIC_USE_AGENT_STORE`` (rendered "True"/"False").
        omp_num_threads: set ``OMP_NUM_THREADS`` to this when the parent has none
            (torchrun sets 1 when nproc-per-node > 1), or None.
        virtual_local_rank: ``--virtual-local-rank``: LOCAL_RANK=0 for every worker
            and CUDA_VISIBLE_DEVICES narrowed to its own device.
    """

    run_id: str
    max_restarts: int
    use_agent_store: bool
    omp_num_threads: int | None = None
    virtual_local_rank: bool = False


def worker_env(
    base: Mapping[str, str],
    worker: Worker,
    group: WorkerGroup,
    restart_count: int,
    error_file: str,
    opts: EnvOptions,
) -> dict[str, str]:
    """Return the full environment of one worker: ``base`` plus torchrun's variables.

    Args:
        base: the agent's environment (inherited by every worker, as torchrun does).
        worker: the worker, ranks assigned.
        group: its WorkerGroup, with group rank/world size and master addr/port set.
        restart_count: failed-group restarts so far (``TORCHELASTIC_RESTART_COUNT``).
        error_file: path for ``TORCHELASTIC_ERROR_FILE``.
        opts: the per-job EnvOptions.

    Returns:
        A new dict of str to str.

    Raises:
        ValueError: with ``virtual_local_rank``, the local rank has no device in
            the parent's CUDA_VISIBLE_DEVICES (as torchrun).
    """
    spec = group.spec
    env = dict(base)
    env.update(
        {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(group.master_addr),
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(opts.max_restarts),
            "TORCHELASTIC_RUN_ID": opts.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(opts.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    if opts.omp_num_threads is not None and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(opts.omp_num_threads)
    env.update(_local_rank_env(worker.local_rank, base.get("CUDA_VISIBLE_DEVICES"), opts.virtual_local_rank))
    return env


def _local_rank_env(local_rank: int, visible: str | None, virtual: bool) -> dict[str, str]:
    """``LOCAL_RANK``; with ``virtual`` (``--virtual-local-rank``) 0, and ``CUDA_VISIBLE_DEVICES``
    narrowed to the worker's own device of the parent's ``visible`` (or its local rank when unset).

    Raises:
        ValueError: with ``virtual``, ``visible`` has no device for ``local_rank`` (as torchrun).
    """
    if not virtual:
        return {"LOCAL_RANK": str(local_rank)}
    if visible is None:
        return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(local_rank)}
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise ValueError(f"local rank {local_rank} exceeds the devices in CUDA_VISIBLE_DEVICES={visible}")
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": devices[local_rank].strip()}
