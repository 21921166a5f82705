"""Memory of a node's launcher tree with warm spares, side by side with torchrun and elaunch without them.

``python -m benchmarks.warm_memory [--nproc-per-node 4] [--repeat 3] [--json FILE]``

Each launcher runs ``--standalone --nproc-per-node=N --max-restarts=1`` with a worker that imports
torch, joins its gloo group, all-reduces once and waits (``benchmarks/workers/sleeper.py``'s
behaviour is not enough: it imports no torch). Once every worker is past its all-reduce and the
tree has had no new process for 2 s (elaunch ``--warm-start``: its spares for the next attempt
forked), the proportional set size (PSS: each page shared by k processes counts 1/k to each) of
every process of the tree, launcher included, is summed: the memory the node spends on the job's
launch. Interleaved: each repeat runs the three in a shuffled order.

elaunch ``--warm-start`` keeps one spare per worker for the next attempt; since session 40 the
spares and the workers are all forked from one template per node that imported torch once, so
they share its pages (before: a template per local rank and first-attempt spares that imported
torch each).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import emit, kill_tree, launcher_cmd, launcher_env, log_line, wait_until

WORKER = """\
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1 << 16)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"ready_{dist.get_rank()}"), "w").close()
while not os.path.exists(os.path.join(sys.argv[1], "stop")):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""
CONFIGS = {
    "torchrun": ("torchrun", ()),
    "elaunch": ("elaunch", ()),
    "elaunch --warm-start": ("elaunch", ("--warm-start",)),
}


def tree_pss(root: int) -> tuple[int, int]:
    """Return the summed PSS in bytes of ``root`` and its descendants, and their number."""
    total, count = 0, 0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
            count += 1
        except psutil.Error:
            pass
    return total, count


def one(name: str, nproc: int, work: Path) -> dict:
    which, flags = CONFIGS[name]
    out = Path(tempfile.mkdtemp(prefix="wm-", dir=work))
    script = work / "worker.py"
    script.write_text(WORKER)
    argv = launcher_cmd(which, "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=1", *flags,
                        str(script), str(out))
    env = {**launcher_env(), "OMP_NUM_THREADS": "1"}
    with open(out / "launcher.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: len(list(out.glob("ready_*"))) == nproc, 120, f"{name}: workers ready", (proc,))
        state = {"pids": None, "since": time.monotonic()}

        def settled():
            pids = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
            if pids != state["pids"]:
                state.update(pids=pids, since=time.monotonic())
            return time.monotonic() - state["since"] >= 2.0

        wait_until(settled, 120, f"{name}: the tree settled", (proc,), interval=0.2)
        pss, count = tree_pss(proc.pid)
        (out / "stop").touch()
        proc.wait(60)
        return {"config": name, "pss_bytes": pss, "processes": count, "exit": proc.returncode}
    finally:
        kill_tree(proc.pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    raw: list[dict] = []
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="warm-memory-") as tmp:
        for i in range(a.repeat):
            order = list(CONFIGS)
            rng.shuffle(order)
            for name in order:
                log_line(f"warm_memory: {name} (repeat {i + 1})")
                raw.append(one(name, a.nproc_per_node, Path(tmp)))
    rows = []
    medians = {name: statistics.median(r["pss_bytes"] for r in raw if r["config"] == name) / 2**20 for name in CONFIGS}
    for name in CONFIGS:
        rows.append({"key": f"warm_memory.{name}", "label": f"{name}: PSS of the launcher's tree, "
                     f"{a.nproc_per_node} workers (torch imported, group joined)", "unit": "MiB",
                     "values": [r["pss_bytes"] / 2**20 for r in raw if r["config"] == name],
                     "median": medians[name], "vs": "warm_memory.torchrun",
                     "ratio": medians[name] / medians["torchrun"]})
    meta = {"command": "python -m benchmarks.warm_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc_per_node": a.nproc_per_node,
            "notes": []}
    table = "\n".join(["| launcher | PSS, median (n) | ratio to torchrun | processes |", "|---|---|---|---|"] + [
        f"| {name} | {medians[name]:.0f} MiB (n={a.repeat}) | {medians[name] / medians['torchrun']:.2f}× | "
        f"{statistics.median(r['processes'] for r in raw if r['config'] == name):g} |" for name in CONFIGS])
    emit(meta, rows, raw, a.json, table)
    return 0 if all(r["exit"] == 0 for r in raw) else 1


if __name__ == "__main__":
    sys.exit(main())
