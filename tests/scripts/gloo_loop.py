"""A torch/gloo worker that all-reduces in a loop and records its progress.

argv[1]: output dir. argv[2]: seconds rank 0 lets a round run (default 600). Each
round (restart count + world size) rank 0 writes progress_<WORLD_SIZE> with the
number of completed all_reduces. The round ends when rank 0's seconds pass or
``<out>/stop`` exists: rank 0 decides, and the decision travels in the all_reduce,
so every rank leaves on the same step and exits 0 (a rank leaving on its own clock
would leave a peer in an all_reduce with no partner). A peer dying makes the
all_reduce raise, so the worker fails and its agent re-forms the group.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
deadline = time.monotonic() + seconds
n = 0
while True:
    stop = rank == 0 and (time.monotonic() >= deadline or os.path.exists(os.path.join(out, "stop")))
    t = torch.tensor([1.0, 1.0 if stop else 0.0])
    dist.all_reduce(t)
    assert int(t[0].item()) == world
    n += 1
    if rank == 0 and n in (1, 5):
        path = os.path.join(out, f"progress_{world}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{n} {os.environ['GROUP_WORLD_SIZE']}")
        os.replace(path + ".tmp", path)
    if t[1].item() > 0:
        break
    time.sleep(0.05)
dist.destroy_process_group()
