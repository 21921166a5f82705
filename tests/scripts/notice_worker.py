"""A worker that counts the notices (SIGUSR1) it receives: argv ``OUT``.

Writes ``OUT/ready_<rank>`` once its handler is installed, appends a line to
``OUT/got_<rank>`` per SIGUSR1, and exits 0 once ``OUT/stop`` exists.
"""

import os
import signal
import sys
import time

out = sys.argv[1]
rank = os.environ["RANK"]


def _got(signum, frame):
    with open(os.path.join(out, f"got_{rank}"), "a") as f:
        f.write(f"{time.time()}\n")


signal.signal(signal.SIGUSR1, _got)
open(os.path.join(out, f"ready_{rank}"), "w").close()
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.02)
