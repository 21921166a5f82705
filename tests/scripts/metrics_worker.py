"""Worker for tests/integration/test_metrics.py: steps with elaunch.progress(step=), local rank 1 crashes once.

argv[1]: output directory. The first attempt's local rank 1 exits 3 at step 5 (its peer
keeps stepping until the agent stops it); every worker of the next attempt steps every
0.05 s until ``<out>/stop`` exists, then exits 0. No torch.
"""
import os
import sys
import time

import elaunch

out = sys.argv[1]
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
step = 0
while not os.path.exists(os.path.join(out, "stop")):
    elaunch.progress(step=step)
    if first and step == 5 and os.environ["LOCAL_RANK"] == "1":
        sys.exit(3)
    step += 1
    time.sleep(0.05)
