"""A small restartable gloo training for the in-process restart tests (``elaunch.restartable``).

``restartable_train.py OUT [--steps N] [--kill R:S] [--raise R:S] [--stop R:S] [--block R:S] [--sleep R:S]
[--own-sigurg PATH] [--profile] [--plain] [--timeout SECONDS] [--step-sleep SECONDS] [--stop-file PATH]
[--destroy-fails] [--abort-hangs R] [--wait-file PATH]``

Every rank trains a tiny linear model (SGD with momentum) on data that depends only on
(step, rank), averages its gradients with gloo ``all_reduce`` and saves model and
optimizer with ``elaunch.checkpoint.save`` after each step; at its start it restores
what ``elaunch.checkpoint.load`` offers and goes on from the next step. In the first
round (``TORCHELASTIC_RESTART_COUNT`` 0), ``--kill R:S`` has rank R SIGKILL itself and
``--raise R:S`` has it raise RuntimeError and ``--stop R:S`` SIGSTOP itself (a hang), each after
step S, writing ``OUT/fault.json`` (the time) first; ``--block R:S`` has rank R sleep an hour
after step S with every signal blocked (a call no interrupt reaches, as a long compute kernel);
``--sleep R:S`` has it sleep an hour in ``time.sleep`` (a wait in a system call, which an
abort's signal ends). ``--own-sigurg PATH``: main() handles SIGURG itself, appending its pid to
PATH at each delivery. ``--profile``: after the first round, main() runs under a profile function
(``sys.setprofile``, as cProfile, a debugger or coverage do). ``--plain``: main() is not
decorated. ``--timeout``: the process group's timeout (seconds; long, so a survivor left
waiting for it would be obvious). ``--step-sleep``: seconds each rank sleeps after each step (a
longer run, for faults driven from outside). ``--stop-file``: after each step the ranks agree (an
``all_reduce``) whether PATH exists, and all end there when it does (a run as long as its driver needs).
``--destroy-fails``: in the first round ``dist.destroy_process_group`` raises before it destroys anything, as
NCCL's shutdown of a communicator broken by a fault does. ``--abort-hangs R``: in the first round rank R's
wrapper never returns from ending the round's collectives (``elaunch.inprocess.worker._abort_collectives`` sleeps
an hour), as a survivor whose ``ncclCommAbort`` hung on a GPU did. ``--wait-file PATH``: in the first round every
rank waits (up to 60 s) for PATH to exist before the step of its fault (``--kill``'s), so a test decides when
the fault comes.

Writes ``OUT/round_<rank>_<pid>_<restart count>_<call>.json`` per call of main() (its number in the process,
world size,
step restored, when the script was loaded, when main() started and when its first step was done, whether the
process is a ``--warm-start`` spare) and, on rank 0 at
the end, ``OUT/final.json`` with the SHA-256 of the final parameters.
"""
import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time

LOADED = time.time()  # the script's first line run: a replacement started before its round runs it then

import torch
import torch.distributed as dist

import elaunch
import elaunch.checkpoint as ckpt

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--kill", default=None)
parser.add_argument("--raise", dest="raise_", default=None)
parser.add_argument("--stop", default=None)
parser.add_argument("--block", default=None)
parser.add_argument("--sleep", default=None)
parser.add_argument("--own-sigurg", default=None)
parser.add_argument("--profile", action="store_true")
parser.add_argument("--plain", action="store_true")
parser.add_argument("--timeout", type=float, default=120.0)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--stop-file", default=None)
parser.add_argument("--destroy-fails", action="store_true")
parser.add_argument("--abort-hangs", type=int, default=None)
parser.add_argument("--wait-file", default=None)
args = parser.parse_args()

if args.abort_hangs is not None and os.environ.get("RANK") == str(args.abort_hangs) \
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import elaunch.inprocess.worker as _worker

    def _planted_abort_that_never_returns(baseline):
        time.sleep(3600)

    _worker._abort_collectives = _planted_abort_that_never_returns

if args.destroy_fails:
    _destroy = dist.destroy_process_group

    def _failing_destroy(group=None):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError("planted: the process group's shutdown failed")
        return _destroy(group)

    dist.destroy_process_group = _failing_destroy


def _fault(spec):
    if spec is None:
        return None, None
    r, s = spec.split(":")
    return int(r), int(s)


def _write(name, data):
    path = os.path.join(args.out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


CALLS = [0]  # main()'s calls in this process


def main():
    CALLS[0] += 1
    if args.own_sigurg:  # the script handles SIGURG itself: each delivery appends a line to the file
        signal.signal(signal.SIGURG, lambda *_: open(args.own_sigurg, "a").write(f"{os.getpid()}\n"))
    started = time.time()
    if args.profile and CALLS[0] > 1:  # a profiler from the second call of main() on, as a user's cProfile
        sys.setprofile(lambda frame, event, arg: None)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.step()  # momentum buffers exist from the start (a state_dict of a fixed shape)
    snap = ckpt.load()
    start = 0
    if snap is not None:
        model.load_state_dict(snap.state["model"])
        opt.load_state_dict(snap.state["opt"])
        start = snap.step + 1
    with open("/proc/self/cmdline", "rb") as f:
        warm = any(a.endswith(b"_warm_child.py") for a in f.read().split(b"\0"))  # a --warm-start spare
    record = {"rank": rank, "pid": os.getpid(), "world": world, "restarts": restarts, "start": start,
              "loaded": LOADED, "started": started, "first_step": None, "warm": warm, "call": CALLS[0]}
    kill, raise_, stop, block = _fault(args.kill), _fault(args.raise_), _fault(args.stop), _fault(args.block)
    sleep = _fault(args.sleep)
    for step in range(start, args.steps):
        if args.wait_file and restarts == 0 and step == kill[1]:
            deadline = time.monotonic() + 60
            while not os.path.exists(args.wait_file) and time.monotonic() < deadline:
                time.sleep(0.02)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
        elaunch.progress(step=step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.stop_file:
            stop = torch.tensor([float(os.path.exists(args.stop_file))])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        if record["first_step"] is None:
            record["first_step"] = time.time()
            _write(f"round_{rank}_{os.getpid()}_{restarts}_{CALLS[0]}.json", record)
        if restarts == 0 and (rank, step) == kill:
            _write("fault.json", {"kind": "kill", "at": time.time(), "rank": rank, "step": step})
            os.kill(os.getpid(), signal.SIGKILL)
        if restarts == 0 and (rank, step) == block:
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            time.sleep(3600)
        if restarts == 0 and (rank, step) == sleep:
            time.sleep(3600)
        if restarts == 0 and (rank, step) == stop:
            _write("fault.json", {"kind": "stop", "at": time.time(), "rank": rank, "step": step})
            os.kill(os.getpid(), signal.SIGSTOP)
        if restarts == 0 and (rank, step) == raise_:
            _write("fault.json", {"kind": "raise", "at": time.time(), "rank": rank, "step": step})
            raise RuntimeError(f"planted fault on rank {rank} after step {step}")
    _write(f"round_{rank}_{os.getpid()}_{restarts}_{CALLS[0]}.json", record)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        _write("final.json", {"sha256": digest, "restarts": restarts})
    dist.destroy_process_group()


if __name__ == "__main__":
    (main if args.plain else elaunch.restartable(main))()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (a known torch race)
