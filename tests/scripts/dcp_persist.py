"""A 2-rank FSDP2 job saving through ``SnapshotWriter`` under ``elaunch --checkpoint-dir``.

``dcp_persist.py OUT CKPT_DIR STEPS``, run by ``elaunch --nproc-per-node=2 --checkpoint-dir=CKPT_DIR``.

Each rank shards a small ``nn.Sequential`` with ``fully_shard`` over
``init_device_mesh("cpu", (WORLD_SIZE,))`` and, for each step 1 .. STEPS, takes one Adam
step and ``dcp.save``s ``{"model": ..., "optim": ...}`` (``get_state_dict``) with
``SnapshotWriter(step=step)``, then waits (deadline 120 s) until the agent's persister has
made that step's DCP directory complete (its ``.metadata``). After the last step it also
``dcp.save``s the same state to ``OUT/reference`` with DCP's own ``FileSystemWriter``,
and rank 0 writes ``OUT/expected.pt``: every tensor of the state in full
(``DTensor.full_tensor()``) and every other value, by key path (``flatten``).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elaunch.checkpoint import SnapshotWriter
from elaunch.checkpoint.dcp import persisted_dir


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def flatten(obj, prefix: str = "") -> dict:
    """``{key path: value}``: DTensors in full, other tensors as they are, lists and dicts walked."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}/{i}"))
        return out
    if isinstance(obj, DTensor):
        return {prefix: obj.full_tensor().detach().clone()}
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    return {prefix: obj}


def main() -> None:
    out, ckpt_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        torch.manual_seed(step)
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.save(state, storage_writer=SnapshotWriter(step=step))
        done = os.path.join(persisted_dir(ckpt_dir, step), ".metadata")
        deadline = time.monotonic() + 120
        while not os.path.exists(done):
            if time.monotonic() > deadline:
                raise SystemExit(f"step {step} was not persisted to {done} within 120 s")
            time.sleep(0.05)
        dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(out, "reference")))
    expected = flatten(state)
    if int(os.environ["RANK"]) == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)

