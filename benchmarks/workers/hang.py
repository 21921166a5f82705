"""A worker for the hang-detection benchmark: rank 1 stops calling progress() and blocks.

argv[1]: output dir, argv[2]: seconds rank 1 makes progress before it hangs (default 1).

Every rank calls ``elaunch.progress()`` every 0.05 s (a no-op under torchrun, or
when elaunch is not importable). Rank 1 stops after argv[2] seconds, writes
``last_progress`` (holding the ``time.time()`` of its last call) and then blocks
forever in a sleep, as a rank stuck in a collective does. Rank 0 keeps going.
"""
import os
import sys
import time

try:
    from elaunch import progress
except ImportError:  # torchrun without elaunch installed: no equivalent
    def progress() -> None:
        pass

out = sys.argv[1]
progress_for = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
rank = int(os.environ["RANK"])
deadline = time.monotonic() + progress_for
while True:
    progress()
    last = time.time()
    if rank == 1 and time.monotonic() >= deadline:
        with open(os.path.join(out, "last_progress.tmp"), "w") as f:
            f.write(repr(last))
        os.replace(os.path.join(out, "last_progress.tmp"), os.path.join(out, "last_progress"))
        while True:
            time.sleep(3600)
    time.sleep(0.05)
