"""Worker that joins a gloo world, all_reduces rank + 1, and writes its environment.

argv[1]: output dir; writes env_<RANK>_<restart>.json with {"env", "sum", "rank", "world_size"}
(rank and world size as the process group sees them). argv[2] (optional): a global rank
that exits 1 on the first attempt, after the all_reduce (the others then fail in the barrier).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
crash_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
name = os.path.join(out, f"env_{os.environ['RANK']}_{restart}.json")
with open(name + ".tmp", "w") as f:
    json.dump({"env": dict(os.environ), "sum": int(t.item()), "rank": rank, "world_size": dist.get_world_size()}, f)
os.replace(name + ".tmp", name)
if rank == crash_rank and restart == "0":
    sys.exit(1)
dist.barrier()
dist.destroy_process_group()
