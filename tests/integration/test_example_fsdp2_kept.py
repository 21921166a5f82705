"""examples/fsdp2_dcp.py in process: a survivor keeps its state only when it holds the agreed step.

A real one-rank FSDP2 model (gloo, ``fully_shard``) in a child process: ``keep`` after a
real optimizer step, then ``take_kept`` into a model built anew on the meta device, as a
new round does. It copies only for the same step, rank and world size; otherwise it copies
nothing and the rank restores from the snapshots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

pytest.importorskip("torch")

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")

CHILD = r"""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
sys.path.insert(0, sys.argv[1])
import fsdp2_dcp as ex

dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
args = ex.parse_args(["--dim", "16", "--layers", "1", "--heads", "2"])
cpu, mesh = torch.device("cpu"), init_device_mesh("cpu", (1,))
model, optim = ex.build(args, cpu, mesh)
ex.train_step(model, optim, *ex.batch(args, 0, 0, 1, cpu))
ex.keep(3, 1, 0, model, optim)

def same(a, b):
    sa, sb = ex._flat(ex.state_of(*a)), ex._flat(ex.state_of(*b))
    return sa.keys() == sb.keys() and all(ex._equal(sa[k], sb[k]) for k in sa)

out = {}
for name, (step, world, rank) in {"other step": (4, 1, 0), "other world": (3, 2, 0), "other rank": (3, 1, 1)}.items():
    fresh = ex.build(args, cpu, mesh, init=False)
    out[name] = [ex.take_kept(*fresh, step, world, rank), len(fresh[1].state)]
fresh = ex.build(args, cpu, mesh, init=False)
out["same"] = [ex.take_kept(*fresh, 3, 1, 0), same(fresh, (model, optim))]
ex.train_step(model, optim, *ex.batch(args, 1, 0, 1, cpu))  # the memory moves past step 3
out["after a step"] = [ex.take_kept(*ex.build(args, cpu, mesh, init=False), 3, 1, 0)]
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_take_kept_copies_only_the_agreed_step_at_the_same_rank_and_world(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, EXAMPLES, str(free_port())], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # nothing copied, not even optimizer state allocated: the restore that follows starts from a clean optimizer
    assert out["other step"] == [False, 0] and out["other world"] == [False, 0] and out["other rank"] == [False, 0]
    assert out["same"] == [True, True], out  # every parameter and every AdamW entry, bit for bit
    assert out["after a step"] == [False], out
