"""A worker whose rank 1 enters uninterruptible sleep (state D) until released.

argv[1]: output directory. Each start appends "<restart> <rank>" to starts.log.
Rank 1 posix_spawns /bin/true with a file action that opens ``<out>/fifo`` for
reading: the child blocks in that open before it can exec, and the worker waits
for it in vfork, in the kernel's uninterruptible (killable) sleep. Opening the
FIFO for writing releases it. The other ranks sleep.
"""
import os
import sys
import time

out = sys.argv[1]
with open(os.path.join(out, "starts.log"), "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']}\n")
if os.environ["RANK"] == "1":
    fifo = os.path.join(out, "fifo")
    try:
        os.mkfifo(fifo)
    except FileExistsError:
        pass
    os.posix_spawn("/bin/true", ["true"], dict(os.environ),
                   file_actions=[(os.POSIX_SPAWN_OPEN, 3, fifo, os.O_RDONLY, 0)])
time.sleep(120)
