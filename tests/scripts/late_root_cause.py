"""Rank 1 fails first (error file written) but is slow to exit; rank 0 then segfaults.

This is what a crashing gloo peer looks like: the survivor dies on the closed
socket before the real culprit's process has finished exiting.
"""
import atexit
import os
import signal
import time

from elaunch.errors import record

rank = int(os.environ["RANK"])


@record
def main():
    if rank == 1:
        atexit.register(time.sleep, 60)  # a slow teardown after the error file is written
        raise ValueError("the real root cause")
    peer_error = os.path.join(os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])), "1", "error.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(peer_error) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGSEGV)


main()
