"""The worker of ``benchmarks/fsdp2_dcp.py``: FSDP2 state saved and restored through DCP, each call timed.

``fsdp2_dcp_bench.py OUT DISK --dim D --layers L [--reps N] [--save-reps]``

The model is examples/fsdp2_dcp.py's (``--layers`` transformer encoder layers of width
``--dim`` and a last Linear, ``fully_shard`` per layer and whole, AdamW), one training step
taken so that the optimizer's moments exist. Then, by what ``SnapshotReader`` finds:

* nothing to restore (the job's first round): with ``--save-reps``, ``--reps`` rounds of every
  way of saving, interleaved (each round in a shuffled order, the same on every rank), each after a barrier and
  timed on every rank (``save_<rank>.json``); then the step :data:`FINAL` saved to memory
  (``SnapshotWriter``) and to ``DISK/step_<FINAL>`` (``FileSystemWriter``);
* a step to restore (a later round): the first ``dcp.load`` from ``SnapshotReader`` timed
  (what a restart costs), then ``--reps`` rounds of a load from memory and a load of the same
  step from ``DISK``, interleaved (``restore_<phase>_<world>_<rank>.json``).

Then it writes ``ready_<phase>_<world>_<rank>`` (its pid; ``OUT/phase`` names what the driver did
last) and waits, out of any collective, for ``OUT/exit`` (the driver kills a worker or a node
meanwhile), and leaves with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.futures import Future

from elaunch.checkpoint import SnapshotReader, SnapshotWriter

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
warnings.filterwarnings("ignore", category=FutureWarning)
#: The step saved last in the first round, restored by every later one.
FINAL = 100_000


class NullWriter(StorageWriter):
    """A DCP storage that stores nothing: ``dcp.save`` with it costs DCP's planning (its collectives) alone."""

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        fut: Future = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items])
        return fut

    def finish(self, metadata, results) -> None:
        pass

    def storage_meta(self):
        return None


class SnapshotPlanner(DefaultSavePlanner):
    """DefaultSavePlanner under a name of its own (DCP's plan cache key)."""


class NullPlanner(DefaultSavePlanner):
    """DefaultSavePlanner under a name of its own (DCP's plan cache key)."""


def build(args, mesh):
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(args.dim, args.heads, 4 * args.dim, dropout=0.0, batch_first=True)
              for _ in range(args.layers)]
    model = nn.Sequential(*layers, nn.Linear(args.dim, args.dim))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8 // dist.get_world_size(), 16, args.dim)
    nn.functional.mse_loss(model(x), x).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def state_of(model, optim) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_reps(args, model, optim, ckpt_group, rank: int) -> dict:
    """``--reps`` rounds of every way of saving, interleaved; seconds per way, this rank's."""
    state = state_of(model, optim)
    step = [0]
    pending = {}

    def next_step() -> int:
        step[0] += 1
        return step[0]

    def snapshot():
        dcp.save(state, storage_writer=SnapshotWriter(step=next_step()))

    def snapshot_cached():
        dcp.save(state, storage_writer=SnapshotWriter(step=next_step()), planner=cached_snapshot)

    def snapshot_async():
        pending["f"] = dcp.async_save(state, storage_writer=SnapshotWriter(step=next_step()), process_group=ckpt_group)

    def fs_async():
        pending["f"] = dcp.async_save(state, checkpoint_id=os.path.join(args.disk, f"rep_async_{step[0]}"),
                                      process_group=ckpt_group)

    def fs_sync():
        dcp.save(state, checkpoint_id=os.path.join(args.disk, f"rep_sync_{step[0]}"))

    def null():
        dcp.save(state, storage_writer=NullWriter())

    def null_cached():
        dcp.save(state, storage_writer=NullWriter(), planner=cached_null)

    # DCP keys its plan cache by the planner's class name: one class per writer, or a cached plan of the
    # null writer (no layout in its storage data) would be taken for SnapshotWriter's
    cached_snapshot = SnapshotPlanner(enable_plan_caching=True)
    cached_null = NullPlanner(enable_plan_caching=True)
    ways = {"snapshot": snapshot, "snapshot_cached": snapshot_cached, "snapshot_async_blocking": snapshot_async,
            "fs_async_blocking": fs_async, "fs_sync": fs_sync, "null": null, "null_cached": null_cached}
    out: dict = {k: [] for k in ways}
    out.update(snapshot_async_total=[], fs_async_total=[], errors={}, async_checked=0, async_uncommitted=0)
    for r in range(args.reps + 1):  # round 0 warms every way up (first slot pages, planners' caches): not kept
        # each round in its own order, the same on every rank (the calls are collective): a rotation would keep
        # each way behind the same one every round (the planning-only save always after the disk save's fsyncs)
        names = list(ways)
        random.Random(r).shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            try:
                blocked = timed(ways[name])
                if name == "snapshot_async_blocking":  # was the step committed when the call returned?
                    out["async_checked"] += 1
                    out["async_uncommitted"] += int(committed_step() != step[0])
                if "f" in pending:
                    pending.pop("f").result()
                    total = time.perf_counter() - t0
                    if r:
                        out[name.replace("_blocking", "_total")].append(total)
            except Exception as exc:  # noqa: BLE001 - a way that fails is reported, the others go on
                out["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
                pending.pop("f", None)
                continue
            if r:
                out[name].append(blocked)
        dist.barrier()
        if rank == 0:
            for entry in os.listdir(args.disk):
                if entry.startswith("rep_"):
                    shutil.rmtree(os.path.join(args.disk, entry), ignore_errors=True)
    out["state_bytes"] = nbytes(state)
    out["cached_probe"] = cached_probe(state, cached_snapshot, next_step)
    return out


def committed_step() -> int | None:
    """The newest step committed in this local rank's slots."""
    from elaunch.checkpoint import slotfile

    shm, local = os.environ["ELAUNCH_CHECKPOINT_SHM"], int(os.environ.get("LOCAL_RANK", "0"))
    newest = slotfile.newest(slotfile.read_info(p) for p in slotfile.slot_paths(shm, local))
    return newest.step if newest else None


def cached_probe(state, planner, next_step) -> dict:
    """What this rank's snapshot holds saved without and with plan caching (the cache warm): items, layout."""
    from elaunch.checkpoint import dcp as edcp

    out = {}
    for name, kw in (("plain", {}), ("cached", {"planner": planner})):
        w = SnapshotWriter(step=next_step())
        dcp.save(state, storage_writer=w, **kw)
        part = edcp._open_part(w.path, w.step)
        out[name] = {"items": len(part.refs), "layout_fqns": len(part.layout["fqns"])}
    return out


def restore_reps(args, model, optim, reader: SnapshotReader) -> dict:
    """The first load from ``reader`` (timed), then ``--reps`` rounds of memory and disk loads, interleaved."""
    state = state_of(model, optim)
    disk = os.path.join(args.disk, f"step_{reader.step}")
    out = {"step": reader.step, "source": reader.source, "first": timed(lambda: dcp.load(state, storage_reader=reader)),
           "memory": [], "disk": [], "state_bytes": nbytes(state)}
    restored = {k: v.detach().clone() for k, v in flat(state).items() if isinstance(v, torch.Tensor)}

    def memory():
        dcp.load(state, storage_reader=SnapshotReader())

    def from_disk():
        dcp.load(state, checkpoint_id=disk)

    for r in range(args.reps):
        for name, fn in ((("memory", memory), ("disk", from_disk)) if r % 2 == 0 else
                         (("disk", from_disk), ("memory", memory))):
            out[name].append(timed(fn))
    dcp.load(state, checkpoint_id=disk)
    now = {k: v for k, v in flat(state).items() if isinstance(v, torch.Tensor)}
    out["tensors"] = len(now)
    out["unequal_to_disk"] = sorted(k for k in now if k not in restored or not torch.equal(local(now[k]),
                                                                                         local(restored[k])))
    return out


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in flat(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in flat(v, f"{prefix}/{i}").items()}
    return {prefix: obj}


def write_json(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("disk")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--save-reps", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(args.out, "phase")) as f:  # the driver's name of what happened before this round
        tag = f"{f.read().strip()}_{world}_{rank}"
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build(args, mesh)
    ckpt_group = dist.new_group(backend="gloo")  # dcp.async_save plans in its thread: a group of its own
    reader = SnapshotReader()
    if reader.step is not None:
        write_json(os.path.join(args.out, f"restore_{tag}.json"), restore_reps(args, model, optim, reader))
    else:
        if args.save_reps:
            write_json(os.path.join(args.out, f"save_{rank}.json"), save_reps(args, model, optim, ckpt_group, rank))
        state = state_of(model, optim)
        dcp.save(state, storage_writer=SnapshotWriter(step=FINAL))
        dcp.save(state, checkpoint_id=os.path.join(args.disk, f"step_{FINAL}"))
    dist.barrier()
    with open(os.path.join(args.out, f"ready_{tag}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(args.out, "exit")):
        time.sleep(0.1)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's teardown after FSDP2 and DCP (see the example)


if __name__ == "__main__":
    main()
