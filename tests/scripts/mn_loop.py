"""A gloo worker for multi-node tests: all-reduces in a loop until told to stop.

argv[1]: output directory (shared by every host). Every round, once the group has
completed its first all_reduce, rank 0 appends ``<WORLD_SIZE> <GROUP_WORLD_SIZE>
<TORCHELASTIC_RESTART_COUNT>`` to ``rounds.txt`` and writes ``world_<WORLD_SIZE>``.
Every worker writes its pid to ``pid_<host addr>_<LOCAL_RANK>_<restart>``.
When ``<out>/stop`` exists (rank 0 looks, the flag is all-reduced so every rank
sees it in the same step) all ranks exit 0. A peer that dies makes the
all_reduce raise, so the worker fails and its agent re-forms the group.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
with open(os.path.join(out, f"pid_{os.environ.get('MN_HOST', 'x')}_{os.environ['LOCAL_RANK']}_{restart}"), "w") as f:
    f.write(str(os.getpid()))
n = 0
while True:
    flag = torch.tensor([1.0, 1.0 if rank == 0 and os.path.exists(os.path.join(out, "stop")) else 0.0])
    dist.all_reduce(flag)
    assert int(flag[0].item()) == world
    n += 1
    if rank == 0 and n == 1:
        with open(os.path.join(out, "rounds.txt"), "a") as f:
            f.write(f"{world} {os.environ['GROUP_WORLD_SIZE']} {restart}\n")
        with open(os.path.join(out, f"world_{world}"), "w") as f:
            f.write(restart)
    if flag[1].item() > 0:
        break
    time.sleep(0.05)
dist.destroy_process_group()
