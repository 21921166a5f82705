"""A worker for sharded state under elaunch: FSDP2 and tensor-parallel DTensors on CPU (gloo), then a per-rank
entry in replicated state.

``ckpt_fsdp.py OUT CKPT_DIR``, run by ``elaunch --nproc-per-node=2 --max-restarts=2 --checkpoint-dir=CKPT_DIR
--checkpoint-persist-interval=0``.

Attempt 0: each rank shards a small model with ``fully_shard`` over ``init_device_mesh("cpu", (2,))``,
takes one Adam step, and makes tensor-parallel DTensors (``Shard(1)``, uneven ``Shard(0)``, ``Replicate``,
``Partial`` on the 1-D mesh; ``(Replicate, Shard(0))`` on a (1, 2) mesh named ("dp", "tp") and ``Shard(0)`` on
its "tp" slice). It tries ``ckpt.save`` of the DTensors with ``replicated=True`` (refused), then saves
``{"model", "optim", "tp", "rank"}`` as step 1 with ``replicated=False``, writes each DTensor's local shard to
``OUT/expected_<rank>.pt`` and ``OUT/fsdp_<rank>.json`` (the refusals, the steps held), and rank 1 kills
itself (SIGKILL) once both saved.
Attempt 1: a fresh model (other values) and zeroed DTensors; ``ckpt.load(into=...)`` fills them in place,
``ckpt.load()`` makes new DTensors on rebuilt meshes, the persisted ``*.pt`` of step 1 (the agent persisted
it when rank 1 died) loads the same way, so does the torchrun path (``ELAUNCH_CHECKPOINT_DIR``), and rank 0
runs a child process without ``torch.distributed`` whose ``ckpt.load()`` raises ``CheckpointError``; ``OUT/restored_<rank>.json`` says what held. Rank
0 copies its persisted file to ``OUT/persisted_rank0.pt`` (for a load at another world size). Then every
rank saves ``{"rank": RANK, ...}`` as replicated step 2 and rank 1 exits with status 1.
Attempt 2: ``ckpt.load()``; ``OUT/replicated_<rank>.json`` says the step and the ``rank`` entry each rank got.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import elaunch.checkpoint as ckpt
from elaunch.checkpoint import persisted, slotfile

out, ckpt_dir = sys.argv[1], sys.argv[2]
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


def wait_for(paths, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: {what} not there within {seconds} s")
        time.sleep(0.01)


def model_and_optim(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return mesh, model, optim


def tp_state(mesh, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(7)) * (0 if zero else 1)
    return {
        "colwise": distribute_tensor(full, mesh, [Shard(1)]),
        "uneven": distribute_tensor(full, mesh, [Shard(0)]),  # local shards of 3 and 2 rows
        "rep": distribute_tensor(full, mesh, [Replicate()]),
        "partial": DTensor.from_local(torch.full((3,), 0.0 if zero else rank + 1.0), mesh, [Partial()],
                                      run_check=False),
        "2d": distribute_tensor(full, mesh2, [Replicate(), Shard(0)]),
        "sub": distribute_tensor(full, mesh2["tp"], [Shard(0)]),
    }


def dtensors(state, path="state"):
    """``{key path: DTensor}`` of every DTensor in ``state`` (dicts and lists)."""
    from torch.distributed.tensor import DTensor

    found = {}
    if isinstance(state, DTensor):
        found[path] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            found.update(dtensors(v, f"{path}[{k!r}]"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            found.update(dtensors(v, f"{path}[{i}]"))
    return found


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def attempt_0() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh, model, optim = model_and_optim(0)
    ckpt.save({"plain": torch.ones(2)}, 0)
    model_sd, optim_sd = get_state_dict(model, optim)
    report = {"kinds": sorted({type(t).__name__ for t in model.state_dict().values()}), "errors": {}}
    tp = tp_state(mesh, zero=False)
    for name, state in (("state_dict", {"model": model.state_dict()}), ("tp", {"tp": tp})):
        try:
            ckpt.save(state, 1, replicated=True)
            err = None
        except Exception as exc:  # noqa: BLE001 - the test checks its class and message
            err = [type(exc).__name__, str(exc)]
        report["errors"][name] = err
    report["held"] = held()
    state = {"model": model_sd, "optim": optim_sd, "tp": tp, "rank": rank}
    ckpt.save(state, 1, replicated=False)
    found = dtensors(state)
    torch.save({k: {"local": v.to_local().detach().clone(), "placements": [repr(p) for p in v.placements],
                    "shape": list(v.shape), "stride": list(v.stride()), "mesh": list(v.device_mesh.shape),
                    "names": v.device_mesh.mesh_dim_names} for k, v in found.items()},
               os.path.join(out, f"expected_{rank}.pt"))
    report["dtensors"] = sorted(found)
    write(f"fsdp_{rank}.json", report)
    open(os.path.join(out, f"saved_{rank}"), "w").close()
    wait_for([os.path.join(out, f"saved_{r}") for r in range(world)], "the other ranks' saves")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the agent stops this rank once rank 1 died
        time.sleep(0.05)
    sys.exit("rank 0 was not stopped within 120 s")


def same(got: dict, expected: dict) -> dict:
    """Per key path: False unless ``got`` holds a DTensor there like the saved one, bit for bit."""
    result = {}
    for k, want in expected.items():
        t = got.get(k)
        result[k] = bool(
            t is not None and [repr(p) for p in t.placements] == want["placements"] and list(t.shape) == want["shape"]
            and list(t.stride()) == want["stride"] and list(t.device_mesh.shape) == want["mesh"]
            and t.device_mesh.mesh_dim_names == want["names"] and torch.equal(bits(t.to_local()), bits(want["local"])))
    return result


def attempt_1() -> None:
    expected = torch.load(os.path.join(out, f"expected_{rank}.pt"), weights_only=True)
    mesh, model, optim = model_and_optim(1)  # other values than the saved ones
    report = {}
    into_model = model.state_dict()
    into_tp = tp_state(mesh, zero=True)
    ptrs = {k: v.to_local().data_ptr() for k, v in into_model.items()}
    tp_ptrs = {k: v.to_local().data_ptr() for k, v in into_tp.items()}
    snap = ckpt.load(into={"model": into_model, "tp": into_tp})
    report["step"] = snap.step
    report["rank"] = snap.state["rank"]
    report["into_same_objects"] = all(snap.state["model"][k] is v for k, v in into_model.items()) and all(
        snap.state["tp"][k] is v for k, v in into_tp.items())
    report["into_same_memory"] = all(into_model[k].to_local().data_ptr() == p for k, p in ptrs.items()) and all(
        into_tp[k].to_local().data_ptr() == p for k, p in tp_ptrs.items())
    params = dict(model.named_parameters())
    report["model_params_hold_saved"] = all(
        torch.equal(bits(params[k].to_local()), bits(expected[f"state['model'][{k!r}]"]["local"])) for k in params)
    report["into"] = same(dtensors(snap.state), expected)
    fresh_state = ckpt.load().state
    report["fresh"] = same(dtensors(fresh_state), expected)
    fresh = fresh_state["tp"]
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    report["full_tensors"] = {k: torch.equal(fresh[k].full_tensor(), full) for k in ("colwise", "uneven", "rep", "2d",
                                                                                     "sub")}
    report["partial_sum"] = fresh["partial"].full_tensor().tolist()  # the reduce op came back: 1 + 2 on 2 ranks
    report["optim_state_is_dtensor"] = sorted({type(v).__name__ for s in snap.state["optim"]["state"].values()
                                               for v in s.values()})

    # the persisted file of step 1, written by the agent's persister when rank 1 died
    pt = persisted.rank_file(ckpt_dir, 1, rank, world)
    wait_for([pt], "the persisted file of step 1")
    if rank == 0:
        shutil.copy(pt, os.path.join(out, "persisted_rank0.pt"))
    raw = torch.load(pt, weights_only=True)["state"]  # torch alone reads it: a dict per DTensor
    report["persisted_raw_kind"] = type(raw["tp"]["uneven"]).__name__
    restore = os.environ["ELAUNCH_CHECKPOINT_RESTORE"]
    os.environ["ELAUNCH_CHECKPOINT_RESTORE"] = pt
    into_tp2 = tp_state(mesh, zero=True)
    from_pt = ckpt.load(into={"tp": into_tp2})
    report["persisted_into_same_objects"] = all(from_pt.state["tp"][k] is v for k, v in into_tp2.items())
    report["persisted"] = same(dtensors(from_pt.state), expected)
    report["persisted_fresh"] = same(dtensors(ckpt.load().state), expected)
    os.environ["ELAUNCH_CHECKPOINT_RESTORE"] = restore

    # the torchrun path (no agent): torch.save files in ELAUNCH_CHECKPOINT_DIR
    shm = os.environ.pop("ELAUNCH_CHECKPOINT_SHM")
    os.environ["ELAUNCH_CHECKPOINT_DIR"] = os.path.join(out, "local")
    ckpt.save(snap.state, 5, replicated=False)
    report["local_save_kept_state"] = type(snap.state["tp"]["uneven"]).__name__  # encoded in a copy
    raw = torch.load(persisted.rank_file(os.path.join(out, "local"), 5, rank, world), weights_only=True)["state"]
    report["local_raw_kind"] = type(raw["tp"]["uneven"]).__name__
    into_tp3 = tp_state(mesh, zero=True)
    local = ckpt.load(into={"tp": into_tp3})
    report["local_step"] = local.step
    report["local_into_same_objects"] = all(local.state["tp"][k] is v for k, v in into_tp3.items())
    report["local"] = same(dtensors(local.state), expected)
    report["local_fresh"] = same(dtensors(ckpt.load().state), expected)
    os.environ["ELAUNCH_CHECKPOINT_SHM"] = shm
    del os.environ["ELAUNCH_CHECKPOINT_DIR"]

    if rank == 0:  # the same slot, in a process without torch.distributed
        child = subprocess.run([sys.executable, "-c", "import elaunch.checkpoint as c; c.load()"],
                               capture_output=True, text=True, timeout=120)
        report["without_process_group"] = [child.returncode, child.stderr.strip().splitlines()[-1:]]
    write(f"restored_{rank}.json", report)
    ckpt.save({"rank": rank, "rng": torch.Generator().manual_seed(1000 + rank).get_state()}, 2)  # replicated
    open(os.path.join(out, f"saved2_{rank}"), "w").close()
    wait_for([os.path.join(out, f"saved2_{r}") for r in range(world)], "the other ranks' second saves")
    if rank == 1:
        sys.exit(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit("rank 0 was not stopped within 120 s")


def attempt_2() -> None:
    snap = ckpt.load()
    write(f"replicated_{rank}.json", {"step": snap.step, "rank": snap.state["rank"],
                                      "rng_is_rank_0s": torch.equal(
                                          snap.state["rng"], torch.Generator().manual_seed(1000).get_state())})


dist.init_process_group("gloo")
try:
    (attempt_0, attempt_1, attempt_2)[restarts]()
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)

