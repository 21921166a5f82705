"""FSDP2 training of a small transformer, checkpointed every step to memory through ``torch.distributed.checkpoint``.

Runs unchanged under ``elaunch``, ``torchrun`` and with no launcher::

    elaunch  --standalone --nproc-per-node=2 examples/fsdp2_dcp.py
    elaunch  --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
             --checkpoint-replicas=1 --checkpoint-dir=/shared/ckpt examples/fsdp2_dcp.py
    torchrun --standalone --nproc-per-node=2 examples/fsdp2_dcp.py

The model (``--layers`` transformer encoder layers of width ``--dim``) is sharded with
``fully_shard`` over a 1-D device mesh of every rank (CPU and gloo here; ``cuda`` and
nccl when CUDA is available). The data is synthetic and a function of ``(--seed, step)``
only: each rank takes its slice of the step's batch, so a run interrupted any number of
times ends with the same parameters as an uninterrupted one (``--final-params`` writes
their SHA-256 to compare), at the same world size.

Checkpoints. After every ``--save-every`` steps every rank calls::

    dcp.save(state, storage_writer=SnapshotWriter(step=step))

``state`` is ``get_state_dict(model, optimizer)`` (DTensors: each rank's shards). Under
elaunch the call returns once this rank's part is in the agent's shared memory; the agent
copies it to peers (``--checkpoint-replicas``) and to ``--checkpoint-dir`` as an ordinary
DCP directory. On start every rank asks ``SnapshotReader().step``: the step the whole job
resumes from (None: a fresh start), then ``dcp.load(state, storage_reader=reader)`` fills
the model's and the optimizer's shards, resharded by DCP when the world size changed (a
node lost and not replaced). Under torchrun the same calls write and read DCP
directories in ``$ELAUNCH_CHECKPOINT_DIR/dcp`` (default ``./elaunch_checkpoints``).
``--async-save`` uses ``dcp.async_save`` instead (the write goes on in DCP's thread, whose
planning collectives run on a gloo group of their own, as DCP asks).

Test and benchmark aids: ``--crash-at RANK:STEP,...`` (the i-th entry: on the i-th
attempt (``TORCHELASTIC_RESTART_COUNT`` = i), global rank RANK kills itself with SIGKILL
right after saving STEP), ``--disk DIR`` (also ``dcp.save`` every step to
``DIR/step_<step>`` with DCP's FileSystemWriter, to compare with), ``--verify-out FILE``
(after a restore, load the same step from ``--disk`` too and write, per rank, whether
every tensor is equal: ``FILE.<rank>.json``), ``--step-sleep SECONDS``,
``--timings FILE`` (per rank, seconds spent in each save, in the last build and in the restore),
``--journal FILE`` (every rank appends a JSON line to FILE when it starts: its attempt, rank,
group rank, world size, and the step restored with its source, or null; one as it completes
each step, saved included: the step; and one just before a ``--crash-at`` SIGKILL: the rank
and step; each with the attempt, the time and the process id).

In-process restart (``--in-process``, elaunch only): the training is wrapped with
``elaunch.restartable``. On a fault (a rank killed, or one whose training raised) the
surviving ranks keep their processes: their round is interrupted, and they run the
training again in the next round, with its ranks and store; everything a round needs
(the process group, the device mesh, the model with ``fully_shard``, the optimizer) is
built inside it, and every rank resumes from the step the job agreed on
(``SnapshotReader().step``); only a dead rank gets a new process. A survivor whose memory
still holds that step (it took no optimizer step after it) copies its own shards
into the new model instead of loading them; the ranks that load do it alone
(``dcp.load(..., no_dist=True)``), since the others do not take part. Under torchrun, or
with no launcher, the flag changes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elaunch.checkpoint import SnapshotReader, SnapshotWriter

try:
    from elaunch import progress
except ImportError:  # pragma: no cover - elaunch is what provides SnapshotWriter
    def progress(step=None):
        return None


# FSDP2 warns when a wrapped module returns a view (the last Linear on a 3-D input); this script makes no
# in-place change to one
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--batch", type=int, default=8, help="global batch size, split over the ranks (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--save-every", type=int, default=1, metavar="STEPS", help="steps between saves (default 1)")
    p.add_argument("--async-save", action="store_true", help="save with dcp.async_save")
    p.add_argument("--disk", default=None, metavar="DIR", help="also save every step to DIR/step_<step> (DCP)")
    p.add_argument("--verify-out", default=None, metavar="FILE", help="compare a restore with --disk's copy")
    p.add_argument("--final-params", default=None, metavar="FILE", help="write the parameters' SHA-256 (rank 0)")
    p.add_argument("--crash-at", type=parse_crashes, default=(), metavar="RANK:STEP,...",
                   help="the i-th attempt's crash: RANK kills itself after saving STEP ('none': no crash)")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS", help="sleep after each step")
    p.add_argument("--timings", default=None, metavar="FILE", help="write save/restore seconds to FILE.<rank>.json")
    p.add_argument("--journal", default=None, metavar="FILE",
                   help="append a JSON line to FILE at each start (step restored, source), at each step's end "
                        "and before each crash")
    p.add_argument("--in-process", action="store_true",
                   help="opt in to elaunch's in-process restart (elaunch.restartable): survivors of a fault keep "
                        "their processes")
    return p.parse_args(argv)


def parse_crashes(text: str) -> tuple[tuple[int, int] | None, ...]:
    out = []
    for entry in filter(None, text.split(",")):
        if entry == "none":
            out.append(None)
            continue
        try:
            rank, step = (int(v) for v in entry.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{entry!r} is not RANK:STEP (integers) or 'none'") from None
        out.append((rank, step))
    return tuple(out)


def build(args: argparse.Namespace, device: torch.device, mesh,
          init: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer. ``init=False`` when a restore follows: the model is
    built on the meta device and its shards allocated uninitialized (``to_empty``), as FSDP2's
    docs advise, since the restore overwrites every value; the random full-size initialisation
    it skips took ~0.1 s of CPU a rank, at every in-process restart too."""
    torch.manual_seed(args.seed)
    with torch.device("meta" if not init else "cpu"):  # initialised on the CPU, as before, then moved
        layers = [nn.TransformerEncoderLayer(args.dim, args.heads, 4 * args.dim, dropout=0.0, batch_first=True)
                  for _ in range(args.layers)]
        model = nn.Sequential(*layers, nn.Linear(args.dim, args.dim))
    if init:
        model = model.to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not init:
        model.to_empty(device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def batch(args: argparse.Namespace, step: int, rank: int, world: int, device: torch.device):
    """This rank's slice of the step's batch: a function of (seed, step) only, split by rank."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch, args.seq, args.dim, generator=g)
    y = torch.randn(args.batch, args.seq, args.dim, generator=g)
    per = args.batch // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def state_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def allocate_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """AdamW's state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter), allocated uninitialised
    for a restore to fill, as ``build(init=False)`` does for the model.

    Without it, ``get_state_dict`` creates the state by running an optimizer step on zero
    gradients, a dozen DTensor operations per parameter whose results the restore overwrites:
    ~0.15-0.2 s a rank at every restart here (4 ranks on 2 cores), on the critical path of an
    in-process restart. A checkpoint that lacks any of these entries fails ``dcp.load`` (DCP's
    default planner loads strictly), so nothing is left uninitialised silently. Other
    optimizers, and AdamW with ``amsgrad``, ``fused`` or ``capturable``, keep torch's way.
    """
    if type(optim) is not torch.optim.AdamW or optim.state:
        return
    if any(g.get("amsgrad") or g.get("fused") or g.get("capturable") for g in optim.param_groups):
        return
    for group in optim.param_groups:
        for p in group["params"]:
            # step: a 0-d tensor of the default float type, as AdamW's own first step makes it on the CPU path
            optim.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(p),
                              "exp_avg_sq": torch.empty_like(p)}


def restore(model, optim, reader: SnapshotReader, alone: bool = False) -> None:
    """Fill the model's and the optimizer's shards with ``reader``'s step. ``alone``: without DCP's planning
    collectives (``no_dist``), for a rank that restores while others keep their state (:func:`take_kept`).
    A ``SnapshotReader`` reads only this node's memory and each rank plans its own reads, so no rank needs
    another's plan; DCP's collectives would only make every rank wait for the slowest one's build."""
    allocate_optimizer_state(optim)
    state = state_of(model, optim)
    with warnings.catch_warnings():  # no_dist: DCP warns that it "assumes the intent is to load in a single process"
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=alone)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


#: In-process restart (``--in-process``): the step this rank's memory holds, for the next round:
#: ``{"step", "world", "rank", "params": {name: local shard}, "optim": {name: {key: local tensor}}}``. Set after
#: each optimizer step and restore, emptied just before each optimizer step, so it never names a step the memory
#: has left. It is used only when the job agrees on that very step, i.e. when every rank saved it. References,
#: not copies: the old round's model is never used again, and only its local tensors are read.
_kept: dict = {}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def keep(step: int, world: int, rank: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Remember that this rank's model and optimizer hold exactly step ``step`` (just taken or restored)."""
    params = dict(model.named_parameters())
    names = {p: n for n, p in params.items()}
    _kept.clear()
    _kept.update(step=step, world=world, rank=rank, params={n: _local(p).detach() for n, p in params.items()},
                 optim={names[p]: {k: _local(v) for k, v in s.items()} for p, s in optim.state.items()})


def take_kept(model: nn.Module, optim: torch.optim.Optimizer, step: int, world: int, rank: int) -> bool:
    """A survivor of an in-process restart whose memory holds the agreed ``step``, at the same rank and world
    size (so the same shards), copies it into the new round's model and optimizer instead of loading it: its
    shards are those of the snapshot it saved. False (nothing copied) otherwise: then it restores.

    The new round's model is built anew (``fully_shard`` on the new mesh): only the old local tensors are
    read, nothing of the old process group is used."""
    if (_kept.get("step"), _kept.get("world"), _kept.get("rank")) != (step, world, rank):
        return False
    params = dict(model.named_parameters())
    allocate_optimizer_state(optim)
    if (params.keys() != _kept["params"].keys() or len(optim.state) != len(params)
            or any(_kept["optim"].get(n, {}).keys() != optim.state[p].keys() for n, p in params.items())):
        return False  # another optimizer, or a state this script does not know: restore it
    with torch.no_grad():
        for n, p in params.items():
            _local(p).copy_(_kept["params"][n])
            for k, v in optim.state[p].items():
                _local(v).copy_(_kept["optim"][n][k])
    return True


def verify(args, model, optim, step: int, rank: int) -> None:
    """Load ``step`` from ``--disk`` into a fresh state and compare it, tensor by tensor, with the restored one."""
    mine, disk = state_of(model, optim), state_of(model, optim)
    disk = {k: _clone(v) for k, v in disk.items()}
    dcp.load(disk, checkpoint_id=os.path.join(args.disk, f"step_{step}"))
    flat_a, flat_b = _flat(mine), _flat(disk)
    unequal = sorted(k for k in flat_a if not _equal(flat_a[k], flat_b.get(k)))
    with open(f"{args.verify_out}.{rank}.json", "w") as f:
        json.dump({"step": step, "tensors": len(flat_a), "unequal": unequal,
                   "world_size": dist.get_world_size(), "source": SnapshotReader().source}, f)


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone() if not isinstance(obj, DTensor) else DTensor.from_local(
            obj.to_local().clone(), obj.device_mesh, obj.placements, shape=obj.shape, stride=obj.stride())
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj}


def _equal(a, b) -> bool:
    a, b = (_local(v) if isinstance(v, torch.Tensor) else v for v in (a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def journal(path: str | None, **record) -> None:
    """Append ``record`` as one JSON line to ``path`` (one short O_APPEND write: lines of ranks do not mix)."""
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps({**record, "pid": os.getpid(), "time": time.time()}) + "\n").encode())
        finally:
            os.close(fd)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = train
    if args.in_process:
        import elaunch

        run = elaunch.restartable(train)  # plain train() where elaunch offers no control channel
    run(args)
    # torch's gloo threads can abort the interpreter's teardown after FSDP2 and DCP ("terminate called without an
    # active exception", SIGABRT: a known race, under torchrun too, in about half of the runs here). Everything is
    # written and the group is destroyed: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step on this rank's slice ``x``, ``y`` (``[batch / world, seq, dim]``); returns the loss."""
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    _kept.clear()  # the optimizer step leaves the step `keep` named: nothing is kept until the caller keeps anew
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss


def train(args: argparse.Namespace) -> None:
    """Join the group, build the sharded model and its optimizer, restore the agreed step, train to ``--steps``."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # cuda:LOCAL_RANK, modulo the GPUs there are (ranks share them where there are fewer: scripts/gpu_shared.py)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.batch % world:
        sys.exit(f"--batch {args.batch} does not split over {world} ranks")
    mesh = init_device_mesh(device.type, (world,))
    reader = SnapshotReader()  # a new round's reader: reader.step is the step this round's job agreed on
    t_build = time.perf_counter()
    model, optim = build(args, device, mesh, init=reader.step is None)
    t_build = time.perf_counter() - t_build
    # dcp.async_save plans in a thread of its own: its collectives need a group of their own (gloo), or they
    # interleave with training's on the default group
    ckpt_group = dist.new_group(backend="gloo") if args.async_save else None
    timings: dict = {"saves": [], "restore": None, "source": None, "build": t_build}

    start, restored, source = 0, None, None
    if reader.step is not None:
        t0 = time.perf_counter()
        # in process, a survivor that holds the agreed step keeps it; the others load alone (no rank waits for
        # another's collectives, since some do not load)
        if args.in_process and take_kept(model, optim, reader.step, world, rank):
            source = "kept"
        else:
            restore(model, optim, reader, alone=args.in_process)
            source = reader.source
        restored = reader.step
        timings["restore"], timings["source"] = time.perf_counter() - t0, source
        if args.in_process:
            keep(reader.step, world, rank, model, optim)
        start = reader.step + 1
        if rank == 0:
            print(f"restored step {reader.step} from {source} (world size {world})", flush=True)
        if args.verify_out and args.disk:
            verify(args, model, optim, reader.step, rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    crash = args.crash_at[attempt] if attempt < len(args.crash_at) else None
    journal(args.journal, event="start", attempt=attempt, rank=rank, world_size=world,
            group_rank=int(os.environ.get("GROUP_RANK", "0") or 0), step=restored, source=source)
    pending = None

    for step in range(start, args.steps):
        loss = train_step(model, optim, *batch(args, step, rank, world, device))
        if args.in_process:
            # the memory is step `step`'s state now, before its save: a fault during the save still finds it
            # kept when the job agrees on this step (every rank committed it); else the job's step is older
            keep(step, world, rank, model, optim)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            t0 = time.perf_counter()
            state = state_of(model, optim)
            if args.async_save:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(state, storage_writer=SnapshotWriter(step=step), process_group=ckpt_group)
            else:
                dcp.save(state, storage_writer=SnapshotWriter(step=step))
            timings["saves"].append(time.perf_counter() - t0)
            if args.disk:
                dcp.save(state, checkpoint_id=os.path.join(args.disk, f"step_{step}"))
            if crash is not None and crash == (rank, step):
                if pending is not None:
                    pending.result()
                journal(args.journal, event="crash", attempt=attempt, rank=rank, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
        progress(step=step + 1)
        journal(args.journal, event="step", attempt=attempt, rank=rank, step=step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if pending is not None:
        pending.result()
    if args.timings:
        with open(f"{args.timings}.{rank}.json", "w") as f:
            json.dump(timings, f)
    final = digest(model)
    if rank == 0:
        last = f", loss {loss.item():.6f}" if start < args.steps else " (restored after the last step: none left)"
        print(f"done: {args.steps} steps{last}", flush=True)
        if args.final_params:
            with open(args.final_params, "w") as f:
                f.write(final + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
