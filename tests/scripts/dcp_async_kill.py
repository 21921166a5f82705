"""``dcp.async_save`` with ``SnapshotWriter``: the part is committed when the call returns (issue 36).

``dcp_async_kill.py OUT CKPT_DIR``, run by ``elaunch --nproc-per-node=2 --max-restarts=1
--checkpoint-dir=CKPT_DIR --checkpoint-persist-interval=0``.

First round: each rank holds a DTensor sharded over ``init_device_mesh("cpu", (2,))``, a plain
tensor and an int; saves step 1 with ``dcp.save``, changes every value, then calls
``dcp.async_save(..., SnapshotWriter(step=2))`` with a planner that plans slowly (5 s in
DCP's thread), so the thread has not reached ``write_data`` when the call returns. Each rank
records the newest step in its slots right after the return (``OUT/staged_<rank>.json``);
after a barrier rank 1 SIGKILLs itself, before any rank's thread planned.
Second round: ``SnapshotReader().step`` and what ``dcp.load`` brings back
(``OUT/restored_<rank>.json``): step 2's values, if step 2 was committed on return; and what
DCP's own ``FileSystemReader`` loads from the directory the agent persisted step 2 to when rank 1
died (``"persisted"``: the part staged before any plan, every item of it).
"""
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from elaunch.checkpoint import SnapshotReader, SnapshotWriter, slotfile
from elaunch.checkpoint.dcp import persisted_dir


class SlowPlanner(DefaultSavePlanner):
    """DCP's default planner, 5 s slower to plan: DCP's thread is still planning when rank 1 is killed."""

    def create_local_plan(self):
        time.sleep(5)
        return super().create_local_plan()


def state_at(step: int, mesh) -> dict:
    full = torch.arange(8.0).reshape(4, 2) + 100 * step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.full((3,), float(step)), "n": step}


def main() -> None:
    out, ckpt_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    reader = SnapshotReader()
    if reader.step is None:
        dcp.save(state_at(1, mesh), storage_writer=SnapshotWriter(step=1))
        group = dist.new_group(backend="gloo")  # DCP's thread plans on a group of its own
        dcp.async_save(state_at(2, mesh), storage_writer=SnapshotWriter(step=2), planner=SlowPlanner(),
                       process_group=group)
        shm, local = os.environ["ELAUNCH_CHECKPOINT_SHM"], int(os.environ["LOCAL_RANK"])
        newest = slotfile.newest(slotfile.read_info(p) for p in slotfile.slot_paths(shm, local))
        with open(os.path.join(out, f"staged_{rank}.json"), "w") as f:
            json.dump({"step": newest.step if newest else None}, f)
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the agent stops this rank when rank 1 is gone
        os._exit(1)
    def fresh() -> dict:
        return {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "b": torch.zeros(3), "n": -1}

    def values(state: dict) -> dict:
        return {"w": state["w"].full_tensor().tolist(), "b": state["b"].tolist(), "n": state["n"]}

    state = fresh()
    dcp.load(state, storage_reader=reader)
    disk = fresh()
    path = persisted_dir(ckpt_dir, 2)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(path, ".metadata")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    dcp.load(disk, storage_reader=dcp.FileSystemReader(path))
    with open(os.path.join(out, f"restored_{rank}.json"), "w") as f:
        json.dump({"step": reader.step, "source": reader.source, **values(state), "persisted": values(disk)}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)


if __name__ == "__main__":
    main()
