"""The in-process restart benchmark's worker (``benchmarks/inprocess.py``): a small gloo DDP training.

``inprocess_train.py OUT --mode {elaunch,plain,nvrx} [--nvrx-interval S] [--pg-timeout S]
[--step-sleep S] [--dim D] [--layers L] [--compile] [--device {cpu,cuda}]``

Every rank trains ``--layers`` ``Linear(dim, dim)`` under ``DistributedDataParallel`` (gloo, CPU:
DDP all-reduces the gradients each step), sleeps ``--step-sleep`` s a step (the rest of a
real step) and saves model and optimizer with ``elaunch.checkpoint.save`` after each step;
``main()`` restores ``elaunch.checkpoint.load(into=...)`` first. ``--compile``: the model DDP wraps
is ``torch.compile(model)`` (inductor, CPU), built again by each call of main() as a script must;
a process that compiled it before keeps dynamo's and inductor's caches. Under elaunch that is the
agent's memory; elsewhere (torchrun, ft_launcher) ``ELAUNCH_CHECKPOINT_DIR``, which the
benchmark puts in ``/dev/shm``.

``--device cuda`` (the GPU check): nccl instead of gloo, the model and its data on
``cuda:LOCAL_RANK`` (modulo the GPUs there are; the benchmark runs the worker through
``scripts/gpu_shared.py``, which lets several ranks share a GPU).

``--mode``: ``elaunch`` wraps ``main`` in ``@elaunch.restartable`` (opts in to in-process
restart); ``plain`` calls it as is (elaunch's full restart, torchrun); ``nvrx`` wraps it in
nvidia-resiliency-ext's ``inprocess.Wrapper`` (its defaults, or every interval and
``last_call_wait`` set to ``--nvrx-interval`` seconds), with the process group on a
``TCPStore`` at ``MASTER_PORT + 1`` as NVRx's examples do (a prefix per iteration).

The journal: each process appends JSON lines to ``OUT/journal/<pid>.jsonl``: ``main``
(a call of main() began), ``step`` (a step done: all-reduce, optimizer, save) and
``raise``; each with ``t`` (``time.time()``, CLOCK_REALTIME: one clock for every process of
the machine), ``pid``, ``rank``, ``world`` and ``call`` (the ``t`` of its main() call); a call's
first ``step`` also has ``first_step_s``, that step's forward, backward and optimizer step,
``phases_s``, the seconds from the call to ``init_process_group``'s return, then the model's build
and restore, then DDP's construction (its first collective: with NCCL, the communicator's set-up),
and ``first_fwd_s``, its forward alone (with ``--compile``, dynamo's and inductor's compilation
of forward and backward, before any collective: this rank's own cost).

Faults and the end come through files the driver writes: ``OUT/raise`` holds a rank; that
rank renames it away (once), journals ``raise`` and raises RuntimeError after its step.
``OUT/stop``: every rank agrees on it in the step's flag all-reduce, main() returns.
"""
import argparse
import datetime
import gc
import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import elaunch.checkpoint as ckpt

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--mode", choices=("elaunch", "plain", "nvrx"), default="plain")
parser.add_argument("--nvrx-interval", type=float, default=None)
parser.add_argument("--pg-timeout", type=float, default=10.0)
parser.add_argument("--step-sleep", type=float, default=0.03)
parser.add_argument("--dim", type=int, default=512)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--compile", action="store_true")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
BACKEND = "nccl" if args.device == "cuda" else "gloo"
if args.device == "cuda":
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
else:
    DEVICE = torch.device("cpu")

os.makedirs(os.path.join(args.out, "journal"), exist_ok=True)
_journal = os.open(os.path.join(args.out, "journal", f"{os.getpid()}.jsonl"),
                   os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)


def journal(ev: str, **fields) -> None:
    fields.update(ev=ev, t=time.time(), pid=os.getpid())
    os.write(_journal, (json.dumps(fields) + "\n").encode())


def _raise_requested(rank: int) -> bool:
    """True once for the rank named in OUT/raise (it renames the file away: nobody else sees it)."""
    path = os.path.join(args.out, "raise")
    try:
        with open(path) as f:
            target = int(f.read().strip() or -1)
    except (OSError, ValueError):
        return False
    if target != rank:
        return False
    try:
        os.rename(path, os.path.join(args.out, f"raised.{os.getpid()}.{time.time():.3f}"))
    except OSError:
        return False
    return True


def _process_group(rank: int, world: int, iteration: int | None) -> None:
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.mode != "nvrx":
        dist.init_process_group(BACKEND, rank=rank, world_size=world, timeout=timeout)
        return
    # as NVRx's examples: the application's own store at MASTER_PORT + 1 (torchrun's agent store is at
    # MASTER_PORT, the Wrapper's at + 2), multi-tenant so a restart in the same process reuses it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world_size=world,
                          is_master=rank == 0, multi_tenant=True, wait_for_workers=False, use_libuv=True,
                          timeout=timeout)
    dist.init_process_group(BACKEND, store=dist.PrefixStore(f"it{iteration}/", store), rank=rank,
                            world_size=world, timeout=timeout)


def main(call_wrapper=None):
    call = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    iteration = call_wrapper.iteration if call_wrapper is not None else None
    journal("main", rank=rank, world=world, call=call, iteration=iteration,
            restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    _process_group(rank, world, iteration)
    phases = {"init_process_group": time.time() - call}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)]).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.step()  # momentum buffers exist from the start: the saved state has one structure
    snap = ckpt.load(into={"model": model.state_dict(), "opt": opt.state_dict()})
    start = 0
    if snap is not None:
        model.load_state_dict(snap.state["model"])
        opt.load_state_dict(snap.state["opt"])
        start = snap.step + 1
    phases["build_and_restore"] = time.time() - call - sum(phases.values())
    ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(model) if args.compile else model,
                                                    device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
    phases["ddp"] = time.time() - call - sum(phases.values())
    flag = torch.zeros(1, device=DEVICE)
    stop_path = os.path.join(args.out, "stop")
    step = start
    first = {}
    while True:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, args.dim, generator=g).to(DEVICE)
        t0 = time.perf_counter()
        loss = ddp(x).pow(2).mean()
        t_fwd = time.perf_counter() - t0
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
        opt.zero_grad()
        if step == start:
            first = {"first_step_s": time.perf_counter() - t0, "first_fwd_s": t_fwd,
                     "phases_s": {k: round(v, 4) for k, v in phases.items()}}
        ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
        time.sleep(args.step_sleep)
        flag.fill_(1.0 if os.path.exists(stop_path) else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        journal("step", rank=rank, world=world, call=call, step=step, **first)
        first = {}
        if flag.item() > 0:
            break
        if _raise_requested(rank):
            journal("raise", rank=rank, world=world, call=call, step=step)
            raise RuntimeError(f"planted fault on rank {rank} after step {step}")
        step += 1
    # DDP's reducer holds the process group: freed with main()'s frame, after `flag`, it destroyed the group
    # there, joining gloo's threads with the GIL held while one of them still released the last all_reduce's
    # work and needed the GIL for `flag` (torch 2.13; a deadlock seen in every --warm-start job after a restart,
    # which then never exited). Freed here, the group goes in destroy_process_group, `flag` still alive.
    del ddp
    gc.collect()
    dist.destroy_process_group()


def _wrapped():
    if args.mode == "elaunch":
        import elaunch

        return elaunch.restartable(main)
    if args.mode == "nvrx":
        import nvidia_resiliency_ext.inprocess as inprocess

        kwargs = {"store_kwargs": {"port": int(os.environ["MASTER_PORT"]) + 2}}
        if args.nvrx_interval is not None:
            every = datetime.timedelta(seconds=args.nvrx_interval)
            kwargs.update(monitor_thread_interval=every, monitor_process_interval=every, heartbeat_interval=every,
                          progress_watchdog_interval=every, last_call_wait=every)

        def nvrx_main(call_wrapper: Optional[inprocess.CallWrapper] = None):  # the Wrapper fills it by its type
            return main(call_wrapper)

        return inprocess.Wrapper(**kwargs)(nvrx_main)
    return main


if __name__ == "__main__":
    _wrapped()()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (a known torch race)
