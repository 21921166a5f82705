"""Saves through SnapshotWriter with DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)).

Usage: dcp_plan_cache.py OUT. Each rank saves three steps of a state holding a replicated
tensor (DCP's dedup gives it to one rank), writes which items its own part of each step
holds (``OUT/items_<rank>.json``), then loads the last step back from memory with
SnapshotReader-like reading of its own part only and records the replicated tensor.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from elaunch.checkpoint import dcp as edcp
from elaunch.checkpoint import slotfile

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"shared": torch.arange(10.0), "n": 5}
held = {}
for step in range(3):
    state["shared"] += 1
    dcp.save(state, storage_writer=edcp.SnapshotWriter(step=step), planner=DefaultSavePlanner(enable_plan_caching=True))
    shm = os.environ["ELAUNCH_CHECKPOINT_SHM"]
    newest = slotfile.newest([slotfile.read_info(p) for p in slotfile.slot_paths(shm, int(os.environ["LOCAL_RANK"]))])
    held[step] = sorted(k[0] for k in edcp._open_part(newest.path, step).refs)
with open(os.path.join(out, f"items_{rank}.json"), "w") as f:
    json.dump(held, f)
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit)

