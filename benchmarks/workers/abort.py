"""A worker for the job-wide abort benchmark: one rank fails, the others block forever.

argv[1]: output dir, argv[2]: the global rank that fails, argv[3]: seconds it waits
after every rank started (default 0.3).

Every rank writes ``ready_{RANK}`` (holding its parent's pid, its agent's) in the output dir. The failing rank waits until
all WORLD_SIZE ranks did, then argv[3] seconds, writes ``crash`` (holding
``time.time()``) just before ``os._exit(1)``. Every other rank then blocks forever
in a sleep, as an NCCL rank does in a collective whose peer is gone: only its
launcher can end it.
"""
import os
import sys
import time

out, fail_rank = sys.argv[1], int(sys.argv[2])
wait = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(out, f"ready_{rank}.tmp"), "w") as f:
    f.write(str(os.getppid()))
os.replace(os.path.join(out, f"ready_{rank}.tmp"), os.path.join(out, f"ready_{rank}"))
if rank == fail_rank:
    while len([n for n in os.listdir(out) if n.startswith("ready_") and not n.endswith(".tmp")]) < world:
        time.sleep(0.01)
    time.sleep(wait)
    with open(os.path.join(out, "crash.tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(out, "crash.tmp"), os.path.join(out, "crash"))
    os._exit(1)
while True:
    time.sleep(3600)
