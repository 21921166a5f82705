"""A process that writes one line to FILE for each SIGTERM it receives and exits 1 s after the first.

    count_signals.py FILE [plain|setsid ...]

Each further argument starts a child running this script with ``FILE.<n>``: ``plain`` stays in this
process's group, ``setsid`` leads a session of its own. The pids (this one's first) go to ``FILE.pids``
once the children have written theirs, so a test knows when every handler is in place.
"""

import os
import signal
import subprocess
import sys
import time

path, kinds = sys.argv[1], sys.argv[2:]
first = []


def on_term(signum, frame):
    with open(path, "a") as f:
        f.write("TERM\n")
    first.append(time.monotonic())


signal.signal(signal.SIGTERM, on_term)
children = [subprocess.Popen([sys.executable, __file__, f"{path}.{n}"], start_new_session=kind == "setsid")
            for n, kind in enumerate(kinds)]
pids = [os.getpid()]
for n, child in enumerate(children):
    while not os.path.exists(f"{path}.{n}.pids"):
        time.sleep(0.01)
    pids.append(child.pid)
with open(path + ".pids.tmp", "w") as f:
    f.write(" ".join(map(str, pids)))
os.replace(path + ".pids.tmp", path + ".pids")
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not (first and time.monotonic() - first[0] > 1.0):
    time.sleep(0.02)  # a second SIGTERM would come within this second
sys.exit(0)
