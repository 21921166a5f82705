"""Worker for the goodput tests of ``elaunch status``: reports steps until <out>/go exists (at most 300 s).

argv[1]: output dir. Writes started_<RANK>_<restart> (its pid) after its first
``elaunch.progress(step=0)``, then calls ``elaunch.progress(step=n)`` every 0.05 s.
"""
import os
import sys
import time

import elaunch

out = sys.argv[1]
rank = os.environ["RANK"]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
elaunch.progress(step=0)
path = os.path.join(out, f"started_{rank}_{restart}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 300
step = 0
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    step += 1
    elaunch.progress(step=step)
    time.sleep(0.05)
