"""A worker that trains a small FSDP2 model on CPU (gloo) and saves every step through DCP, to memory and to disk.

``dcp_reshard.py OUT DISK STOP [SLEEP]``, run by elaunch with ``--checkpoint-replicas`` (no ``--checkpoint-dir``).

Each step: one AdamW step, then ``dcp.save`` of ``get_state_dict(model, optim)`` to ``DISK/step_<step>``
(DCP's FileSystemWriter; a directory every host sees), then to memory with ``SnapshotWriter(step=step)``
(in that order: a step in memory is whole on disk too), then ``OUT/saved_<rank>_<world>_<step>`` and a
sleep of SLEEP seconds (default 0.3). ``OUT/env_<rank>_<world>.json`` holds the worker's ``ELAUNCH_CHECKPOINT_*`` variables.

On start, when ``SnapshotReader().step`` is set, every rank loads that step from memory (resharded by DCP
when the world size changed), then loads the same step from ``DISK`` into a second model of the same world
and compares the two states tensor by tensor (each DTensor's local shard, its placements, every other
value): ``OUT/verdict_<rank>_<world>.json`` = ``{"step", "world", "source", "tensors", "unequal": [...]}``.
A start with nothing to restore writes ``OUT/fresh_<rank>_<world>``.
It exits 0 once ``STOP`` exists (any rank seeing it after a step stops them all).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elaunch.checkpoint import SnapshotReader, SnapshotWriter

out, disk, stop = sys.argv[1:4]
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.3
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def write(name: str, obj) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(obj, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))  # 12 and 5 rows: uneven shards at 4 ranks
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def state_of(model, optim) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def flat(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}


def same(a, b) -> bool:
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return (isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements
                and a.shape == b.shape and torch.equal(a.to_local(), b.to_local()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


write(f"env_{rank}_{world}.json", {k: v for k, v in os.environ.items() if k.startswith("ELAUNCH_CHECKPOINT")})
model, optim = build(0)
start = 0
reader = SnapshotReader()
if reader.step is not None:
    state = state_of(model, optim)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    mine = flat(state_of(model, optim))
    ref_model, ref_optim = build(1)  # other values: only the load can make them equal
    ref = state_of(ref_model, ref_optim)
    dcp.load(ref, checkpoint_id=os.path.join(disk, f"step_{reader.step}"))
    set_state_dict(ref_model, ref_optim, model_state_dict=ref["model"], optim_state_dict=ref["optim"])
    theirs = flat(state_of(ref_model, ref_optim))
    unequal = sorted(k for k in mine.keys() | theirs.keys() if k not in mine or k not in theirs
                     or not same(mine[k], theirs[k]))
    write(f"verdict_{rank}_{world}.json", {"step": reader.step, "world": world, "source": reader.source,
                                          "tensors": len(mine), "unequal": unequal})
    start = reader.step + 1
else:
    write(f"fresh_{rank}_{world}", {})

for step in range(start, 10**6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * 2, 8, generator=g)[rank * 2:rank * 2 + 2]
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()
    state = state_of(model, optim)
    dcp.save(state, checkpoint_id=os.path.join(disk, f"step_{step}"))
    dcp.save(state, storage_writer=SnapshotWriter(step=step))
    open(os.path.join(out, f"saved_{rank}_{world}_{step}"), "w").close()
    flag = torch.tensor([int(os.path.exists(stop))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops after the same step
    if flag.item():
        break
    time.sleep(pause)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)
