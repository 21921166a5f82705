"""A torch/gloo worker: init, all_reduce, and rank <crash_rank> exits 1 on the first attempt.

argv[1]: crash rank (-1: none). argv[2]: output dir; rank 0 writes done_<restart> with the
all_reduce result after a successful round. The crash happens after the process group
formed, so the restarted group must not read the dead workers' store keys.
"""
import os
import sys

import torch
import torch.distributed as dist

crash_rank = int(sys.argv[1])
out = sys.argv[2]
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
if rank == crash_rank and restart == 0:
    sys.exit(1)
dist.barrier()
if rank == 0:
    with open(os.path.join(out, f"done_{restart}"), "w") as f:
        f.write(str(int(t.item())))
dist.destroy_process_group()
