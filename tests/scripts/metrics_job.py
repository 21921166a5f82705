"""Worker for the Prometheus test: reports steps with elaunch.progress(step=), global rank 1 crashes once.

argv[1]: output directory. argv[2]: the step at which global rank 1 exits 3 in the
first attempt (the others stop advancing there and wait to be stopped). A restarted
attempt resumes from argv[3] (as from a checkpoint) and counts on, one step every
0.05 s, until ``<out>/stop`` exists: then it exits 0. No torch: nothing but the
launcher's own behaviour is measured.
"""
import os
import sys
import time

import elaunch

out, crash_at, resume_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
step = 0 if first else resume_at
while not os.path.exists(os.path.join(out, "stop")):
    elaunch.progress(step=step)
    if first and step == crash_at:
        if os.environ["RANK"] == "1":
            time.sleep(0.2)  # the agent reads the step before the exit
            sys.exit(3)
        time.sleep(3600)  # stopped by the agent
    step += 1
    time.sleep(0.05)
