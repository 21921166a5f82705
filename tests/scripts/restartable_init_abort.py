"""A restartable main() whose first round is aborted while rank 0 is inside init_process_group.

    restartable_init_abort.py OUT [--leave-thread]

Round 0: rank 1 never initializes (the test SIGKILLs it), rank 0 writes ``OUT/entering_init`` and
enters ``init_process_group``, where it waits for rank 1 until the abort. Round 1: both ranks
initialize, all-reduce a one and write ``OUT/done_<rank>_<restart count>`` (the sum) and their pid.
``--leave-thread``: rank 0's first round also starts a non-daemon thread, which round 1 stops at its end.
"""

import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import elaunch

OUT = sys.argv[1]
LEAVE_THREAD = "--leave-thread" in sys.argv[2:]
STOP = threading.Event()


@elaunch.restartable
def main():
    rank, restarts = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(OUT, f"pid_{rank}_{restarts}"), "w") as f:
        f.write(str(os.getpid()))
    if restarts == 0 and rank == 1:
        threading.Event().wait()  # until the test's SIGKILL
    if restarts == 0:
        if LEAVE_THREAD:
            threading.Thread(target=STOP.wait, name="left-by-round-0").start()
        open(os.path.join(OUT, "entering_init"), "w").close()
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(os.path.join(OUT, f"done_{rank}_{restarts}"), "w") as f:
        f.write(f"{t.item()} {os.getpid()}")
    dist.destroy_process_group()
    STOP.set()


if __name__ == "__main__":
    main()
