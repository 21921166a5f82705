"""Worker for the agent's in-memory checkpoint tests: load, save steps, maybe die, report as JSON.

``ckpt_worker.py OUT STEPS [--die-rank R --die-after K] [--wait-for PATH] [--sharded]``

Writes ``OUT/<rank>_<restart count>.json`` (``..._<pid>.json`` when that exists: a
group re-formed without a counted restart) with what ``ckpt.load()`` returned (its step,
and whether the state matched what was saved), the ``ELAUNCH_CHECKPOINT_*`` variables and
the node directory's mode, then saves steps from the restored one + 1 (or 0) to STEPS - 1,
each state a tensor filled with the step (sharded: 100 * step + rank), and marks each
save as ``OUT/saved_<rank>_<step>``. In the first attempt, rank R SIGKILLs itself once
every rank saved step K. With ``--wait-for`` it waits (up to 120 s) for PATH to exist
after saving, before exiting.
"""
import json
import os
import signal
import stat
import sys
import time

import torch

import elaunch.checkpoint as ckpt

out, steps = sys.argv[1], int(sys.argv[2])
args = sys.argv[3:]


def arg(name, default=None):
    return args[args.index(name) + 1] if name in args else default


signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a forwarded notice: keep running
rank = int(os.environ["RANK"])
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
die_rank, die_after = int(arg("--die-rank", -1)), int(arg("--die-after", -1))
replicated = "--sharded" not in args
world = int(os.environ["WORLD_SIZE"])


def value(step):
    return float(step) if replicated else float(step * 100 + rank)


error = None
try:
    snap = ckpt.load()
except ckpt.CheckpointError as exc:
    snap, error = None, str(exc)
shm = os.environ.get("ELAUNCH_CHECKPOINT_SHM")
report = {
    "rank": rank, "restarts": restarts, "pid": os.getpid(),
    "step": None if snap is None else snap.step,
    "state_ok": None if snap is None else bool((snap.state["w"] == value(snap.step)).all()),
    "error": error,
    "env": {k: v for k, v in os.environ.items() if k.startswith("ELAUNCH_CHECKPOINT")},
    "shm_mode": None if not shm else stat.S_IMODE(os.stat(shm).st_mode),
    "warm": any(a.endswith(b"_warm_child.py") for a in open("/proc/self/cmdline", "rb").read().split(b"\0")),
}
name = f"{rank}_{restarts}"
if os.path.exists(os.path.join(out, name + ".json")):  # a re-formed group (not counted): same rank and count
    name += f"_{os.getpid()}"
with open(os.path.join(out, name + ".json.tmp"), "w") as f:
    json.dump(report, f)
os.replace(os.path.join(out, name + ".json.tmp"), os.path.join(out, name + ".json"))
if error is not None:
    sys.exit(3)
start = 0 if snap is None else snap.step + 1
for step in range(start, steps):
    ckpt.save({"w": torch.full((1024,), value(step)), "step": step}, step, replicated=replicated)
    open(os.path.join(out, f"saved_{rank}_{step}"), "w").close()
    if restarts == 0 and rank == die_rank and step == die_after:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out, f"saved_{r}_{step}")) for r in range(world)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
wait = arg("--wait-for")
if wait:
    deadline = time.monotonic() + 120
    while not os.path.exists(wait) and time.monotonic() < deadline:
        time.sleep(0.05)
