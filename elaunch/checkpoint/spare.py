"""The checkpoint feature's warm-spare hook: a spare maps its local rank's snapshot slots while it waits.

A restarted worker's first two ``ckpt.save`` calls took 0.3 s each instead of 0.05 s:
every page of the two slot files faulted into the new process's mapping. The slots
exist from the second attempt on (the workers before saved into them), and on a
replacement node from its first round that restores (its agent reserves them,
``CheckpointKeeper._reserve_slots``); a spare maps them while it waits (:func:`premap`),
and the worker it becomes finds them mapped.

The warm pool knows nothing of checkpoints: the agent names this hook (:data:`HOOK`) to
its launcher, the warm pool puts it in the spares' own environment
(``procs.warm.WARM_HOOK_ENV``; never in a worker's), and a spare calls whatever hook is
named there (``procs/_warm_child.py``). Stdlib only when
imported: a warm template imports it after its modules, before it forks spares (a cold
spare, after its modules too); what a worker's saves and restores import (``_shm``,
``_tree``, ``_read``, ``_local``; ``dcp`` when ``torch.distributed.checkpoint`` is loaded) is
imported with it only when torch is already there, so that a low-priority thread never
imports torch while holding the import lock the script needs. A replacement worker's
import of ``SnapshotReader`` took 50-90 ms of its start (namespace hosts, 2 loaded cores)
before these were inherited from the template.
"""

from __future__ import annotations

import os
import sys
import time

from elaunch.checkpoint import slotfile

if "torch" in sys.modules:  # a worker's imports at its first save or restore, done before the handoff
    from elaunch.checkpoint import _local, _read, _shm, _tree  # noqa: F401

    if "torch.distributed.checkpoint" in sys.modules:  # SnapshotWriter, SnapshotReader
        from elaunch.checkpoint import dcp  # noqa: F401

#: The hook the agent names to its warm pool (``module:function``).
HOOK = "elaunch.checkpoint.spare:premap"


def premap(wait: float = 0.0) -> None:
    """Map this worker's local rank's slots (``ELAUNCH_CHECKPOINT_SHM``, ``LOCAL_RANK``) and fault them in.

    Args:
        wait: seconds to wait for the workers before to create the slots (a spare forked
            before the first saves of the workers it replaces); 0: only slots already there.

    Nothing when the job saves no snapshot; never raises (the worker's save maps them itself).
    """
    shm = os.environ.get("ELAUNCH_CHECKPOINT_SHM")
    if not shm:
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    slots = slotfile.slot_paths(shm, local_rank)
    deadline = time.monotonic() + wait
    while not all(os.path.exists(p) for p in slots) and time.monotonic() < deadline:
        time.sleep(0.25)
    if not any(os.path.exists(p) for p in slots):
        return
    try:
        from elaunch.checkpoint import _shm

        _shm.premap(shm, local_rank)
    except Exception:  # noqa: BLE001 - the worker's save maps them itself
        pass
