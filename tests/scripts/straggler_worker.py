"""A synchronous gloo worker for the straggler watch's tests: all-reduce, own work, ``elaunch.progress(step=)``.

argv[1]: output directory (shared by every host); argv[2]: ``cpu`` (busy for argv[3] seconds of
this process's CPU time per step: a CPU cap slows it) or ``jitter`` (sleeps argv[3] x a random
0.8-1.2 per step). Every worker writes its pid to ``pid_<MN_HOST>_<LOCAL_RANK>``; once the group
made its first step, rank 0 writes ``training`` and ``world_<WORLD_SIZE>``. When
``<out>/stop`` exists (rank 0 looks; the flag is all-reduced, so every rank sees it in the same
step) all ranks exit 0.
"""
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import elaunch

out, mode, base = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(out, f"pid_{os.environ.get('MN_HOST', 'x')}_{os.environ['LOCAL_RANK']}"), "w") as f:
    f.write(str(os.getpid()))
rng = random.Random(rank)
step = 0
while True:
    flag = torch.tensor([1.0 if rank == 0 and os.path.exists(os.path.join(out, "stop")) else 0.0])
    dist.all_reduce(flag)  # the step's collective: every rank leaves it together
    if flag.item() > 0:
        break
    if mode == "cpu":
        until = time.process_time() + base
        while time.process_time() < until:
            pass
    else:
        time.sleep(base * rng.uniform(0.8, 1.2))
    elaunch.progress(step=step)
    if rank == 0 and step == 0:
        open(os.path.join(out, f"world_{dist.get_world_size()}"), "w").close()
        open(os.path.join(out, "training"), "w").close()
    step += 1
dist.destroy_process_group()
