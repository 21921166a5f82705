"""Rank 1 fails first (error file written) but is slow to exit; rank 0 then fails.

This is what a crashing gloo peer looks like: the survivor dies on the closed
socket before the real culprit's process has finished exiting. With argument
``segv`` rank 0 dies of SIGSEGV (no error file); with ``raise`` it raises too,
so both error files exist, written within the same whole second (the
resolution of the file's own timestamp).
"""
import atexit
import os
import signal
import sys
import time

from elaunch.errors import record

rank = int(os.environ["RANK"])
how = sys.argv[1] if len(sys.argv) > 1 else "segv"


@record
def main():
    if rank == 1:
        atexit.register(time.sleep, 60)  # a slow teardown after the error file is written
        while time.time() % 1.0 > 0.5:  # leave room in this second for rank 0's error
            time.sleep(0.01)
        raise ValueError("the real root cause")
    peer_error = os.path.join(os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])), "1", "error.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(peer_error) and time.monotonic() < deadline:
        time.sleep(0.01)
    if how == "raise":
        raise RuntimeError("a peer's collective broke")
    os.kill(os.getpid(), signal.SIGSEGV)


main()
