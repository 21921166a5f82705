"""Saving and loading without elaunch's shared memory (torchrun, no launcher): a local directory.

The worker writes the persisted layout (:mod:`elaunch.checkpoint.persisted`) itself,
synchronously, into ``ELAUNCH_CHECKPOINT_DIR`` (default ``./elaunch_checkpoints``).
Replicated state is written by local rank 0 only (one file per node, as the persister
does); sharded state by every rank. Once a step is complete, the writer prunes the steps
older than the complete one before it: two complete steps stay, so ranks whose saves
are one step apart (a rank killed between its save and its peer's) still agree on one.

A DTensor (sharded state) is written as a dict of primitives and its local shard
(``_tree.encode_dtensors``), as the persister writes it, so the file needs no process
group to load; ``ckpt.load`` makes it a DTensor again.

On load, each rank finds its newest complete step; when ``torch.distributed`` is
initialized, the ranks agree on the smallest of them (one ``all_reduce(MIN)``), so they
never resume from different steps.
"""

from __future__ import annotations

import os
from typing import Any

from elaunch.checkpoint import persisted

DEFAULT_DIR = "elaunch_checkpoints"


def directory() -> str:
    """The checkpoint directory: ``ELAUNCH_CHECKPOINT_DIR``, else ``./elaunch_checkpoints``."""
    return os.environ.get("ELAUNCH_CHECKPOINT_DIR") or DEFAULT_DIR


def save(state: Any, step: int, *, replicated: bool, rank: int, world_size: int, local_rank: int) -> str | None:
    """Write this rank's file for ``step`` (replicated state: local rank 0 only); return its path or None.

    Raises:
        TypeError: as ``ckpt.save`` under elaunch (the state is packed once to check it).
    """
    from elaunch.checkpoint import _tree

    _tree.pack(state, replicated)  # the same TypeErrors as under elaunch (DTensor, weights-only), before any write
    if replicated and local_rank != 0:
        return None
    if not replicated:
        state = _tree.encode_dtensors(state)  # the state itself is not changed
    d = directory()
    path = persisted.write_rank_file(d, step, rank, world_size, replicated, state)
    done = persisted.newest_complete(d)
    if done is not None and done[0] == step:  # keep the previous complete step: ranks one save apart agree on it
        before = persisted.newest_complete(d, step - 1)
        if before is not None:
            persisted.prune(d, before[0])
    return path


def _usable(d: str, rank: int, world_size: int, at_most: int | None) -> tuple[int, str] | None:
    """This rank's newest complete step (no newer than ``at_most``) and the file it loads."""
    from elaunch.checkpoint import CheckpointError

    found = persisted.newest_complete(d, at_most)
    if found is None:
        return None
    step, files, replicated = found
    if replicated:
        return step, files.get(rank) or files[min(files)]
    world = int(os.path.basename(files[min(files)]).rsplit("_", 1)[1].removesuffix(".pt"))
    if world != world_size or rank not in files:
        raise CheckpointError(
            f"the newest sharded checkpoint in {d} (step {step}) was saved by a world of {world} ranks, this run "
            f"has {world_size}: reshard it (torch.distributed.checkpoint) or run with {world} ranks")
    return step, files[rank]


def _agree(step: int) -> int:
    """The smallest ``step`` of all ranks when ``torch.distributed`` is initialized, else ``step``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return step
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([step], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def load(map_location, *, rank: int, world_size: int):
    """This rank's state at the newest step every rank has: ``(step, state)`` or None.

    DTensors come back as the entries ``_tree.encode_dtensors`` wrote (``ckpt.load`` decodes them).
    """
    from elaunch.checkpoint import CheckpointError

    d = directory()
    own = _usable(d, rank, world_size, None)
    agreed = _agree(own[0] if own else -1)
    if agreed < 0:
        return None
    if own[0] != agreed:
        own = _usable(d, rank, world_size, agreed)
        if own is None or own[0] != agreed:
            raise CheckpointError(f"the ranks agreed on step {agreed}, which {d} no longer holds whole for rank {rank}")
    payload = persisted.load_rank_file(own[1], map_location)
    return agreed, payload["state"]
