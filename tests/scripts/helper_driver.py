"""An agent stand-in for the helper-process kill -9 test: ``helper_driver.py TMPDIR``.

Starts the reaper and one helper (``helper_child.py``, policy restart), makes it
exit once and restarts it, has the new one fork a sleeper into its group, writes
"<helper pid> <sleeper pid>" to TMPDIR/pids and sleeps until killed.
"""

import os
import sys
import time

from elaunch.procs import start_reaper
from elaunch.procs.helper_process import HelperProcess

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper_child.py")


def main(tmp: str) -> None:
    reaper = start_reaper()
    helper = HelperProcess("tiny", CHILD, reaper=reaper, restarts=1)
    helper.start()
    helper.chan.send(b"exit 1")
    while not helper.check():  # the restarted one is the one to be watched now
        time.sleep(0.01)
    helper.chan.send(b"fork")
    sleeper = int(helper.chan.recv(64))
    reaper.sync()
    with open(os.path.join(tmp, "pids.tmp"), "w") as f:
        f.write(f"{helper.pid} {sleeper}")
    os.replace(os.path.join(tmp, "pids.tmp"), os.path.join(tmp, "pids"))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
