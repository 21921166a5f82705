"""A torch/gloo worker that all-reduces in a loop and records its progress.

argv[1]: output dir. argv[2]: seconds to run per round (default 600). Each round
(restart count + world size) rank 0 writes progress_<WORLD_SIZE> with the number of
completed all_reduces; the worker exits 0 after the given seconds. A peer dying makes
the all_reduce raise, so the worker fails and its agent re-forms the group.
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
while time.monotonic() < deadline:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == world
    n += 1
    if rank == 0 and n in (1, 5):
        path = os.path.join(out, f"progress_{world}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{n} {os.environ['GROUP_WORLD_SIZE']}")
        os.replace(path + ".tmp", path)
    time.sleep(0.05)
dist.destroy_process_group()
