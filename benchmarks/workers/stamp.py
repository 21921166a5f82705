"""A worker that writes time.time() stamps to files, for the restart and elastic benchmarks.

argv[1]: output dir. argv[2]: mode:

* ``start``: stamp ``start`` and exit 0 (no torch import).
* ``restart``: stamp ``start``; import torch. On restart 0, rank 1 waits argv[3]
  seconds (default 0: a job runs a while before it crashes), stamps ``crash``
  and exits 1 while the others sleep (their agent must stop them). On later
  restarts: init gloo + barrier, stamp ``ready``, exit 0. The crash comes before
  the process group forms: after it formed, torchrun 2.13's restarted group
  usually fails to connect (it reads the dead workers' store keys), which would
  leave no torchrun restart latency to compare.
* ``loop``: stamp ``start``; init gloo + barrier; stamp ``ready``; all_reduce every
  0.1 s for argv[3] seconds (a dead peer makes it raise, so the worker fails).

A stamp is a file ``{kind}_w{WORLD_SIZE}_r{RESTART}_k{RANK}_{pid}`` holding the time.
"""
import time

T0 = time.time()  # as early as possible: this is "the worker is running"

import os  # noqa: E402
import sys  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def stamp(kind, t):
    name = os.path.join(out, f"{kind}_w{world}_r{restart}_k{rank}_{os.getpid()}")
    with open(name + ".tmp", "w") as f:
        f.write(repr(t))
    os.replace(name + ".tmp", name)


stamp("start", T0)
if mode == "start":
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if mode == "restart" and restart == 0:
    if rank == 1:
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
        stamp("crash", time.time())
        os._exit(1)
    time.sleep(300)
dist.init_process_group("gloo")
dist.barrier()
stamp("ready", time.time())
if mode == "restart":
    dist.destroy_process_group()
    sys.exit(0)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.1)
dist.destroy_process_group()
