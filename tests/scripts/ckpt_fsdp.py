"""A worker for sharded state under elaunch: FSDP2 on CPU (gloo), then a per-rank entry in replicated state.

``ckpt_fsdp.py OUT``, run by ``elaunch --nproc-per-node=2 --max-restarts=1``.

Attempt 0: each rank shards a small model with ``fully_shard`` over
``init_device_mesh("cpu", (WORLD_SIZE,))``, takes one Adam step, saves a plain state as
step 0, then tries ``ckpt.save`` of ``model.state_dict()`` and of ``get_state_dict(model,
optim)`` (DTensors) under ``replicated=True`` and ``False``, and writes
``OUT/fsdp_<rank>.json``: each attempt's error (class and message) and the steps its two
slots hold after them. Then every rank saves ``{"rank": RANK, ...}`` (a per-rank entry)
as replicated step 1, and rank 1 exits with status 1 once both saved.
Attempt 1: ``ckpt.load()``; ``OUT/restored_<rank>.json`` says the step and the ``rank``
entry each rank got back.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import elaunch.checkpoint as ckpt
from elaunch.checkpoint import slotfile

out = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def write(name: str, obj) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(obj, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def held() -> list:
    shm = os.environ["ELAUNCH_CHECKPOINT_SHM"]
    infos = [slotfile.read_info(p) for p in slotfile.slot_paths(shm, int(os.environ["LOCAL_RANK"]))]
    return sorted(i.step for i in infos if i is not None)


def attempt_0() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    ckpt.save({"plain": torch.ones(2)}, 0)
    model_sd, optim_sd = get_state_dict(model, optim)
    report = {"kinds": sorted({type(t).__name__ for t in model.state_dict().values()}), "errors": {}}
    for name, state in (("state_dict", {"model": model.state_dict()}),
                        ("get_state_dict", {"model": model_sd, "optim": optim_sd})):
        for replicated in (True, False):
            try:
                ckpt.save(state, 1, replicated=replicated)
                err = None
            except Exception as exc:  # noqa: BLE001 - the test checks its class and message
                err = [type(exc).__name__, str(exc)]
            report["errors"][f"{name}/{'replicated' if replicated else 'sharded'}"] = err
    report["held"] = held()
    write(f"fsdp_{rank}.json", report)
    gen = torch.Generator().manual_seed(1000 + rank)
    ckpt.save({"rank": rank, "rng": gen.get_state()}, 1)  # replicated (the default): per-rank entries
    open(os.path.join(out, f"saved_{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out, f"saved_{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: the other ranks did not save within 60 s")
        time.sleep(0.01)
    if rank == 1:
        sys.exit(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the agent stops this rank once rank 1 failed
        time.sleep(0.05)
    sys.exit("rank 0 was not stopped within 120 s")


def attempt_1() -> None:
    snap = ckpt.load()
    write(f"restored_{rank}.json", {"step": snap.step, "rank": snap.state["rank"],
                                    "rng_is_rank_0s": torch.equal(
                                        snap.state["rng"], torch.Generator().manual_seed(1000).get_state())})


dist.init_process_group("gloo")
try:
    attempt_0() if restarts == 0 else attempt_1()
finally:
    dist.destroy_process_group()
