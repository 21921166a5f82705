"""Worker for the goodput events' tests: reports steps with elaunch.progress(step=), crashes once, resumes earlier.

argv[1]: the step at which local rank 1 exits 3 in the first attempt (local rank 0 stops
advancing there: the node's highest step before the failure is exactly it).
argv[2]: the step a restarted attempt resumes from (as from a checkpoint); it then runs to
argv[3] (the last step), one step every 0.05 s.
"""
import os
import sys
import time

import elaunch

crash_at, resume_at, last = (int(a) for a in sys.argv[1:4])
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
for step in range(0 if first else resume_at, last + 1):
    elaunch.progress(step=step)
    if first and step == crash_at:
        if os.environ["LOCAL_RANK"] == "1":
            time.sleep(0.2)  # the agent reads the step before the exit
            sys.exit(3)
        time.sleep(3600)  # stopped by the agent
    time.sleep(0.05)
