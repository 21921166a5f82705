"""Worker that records what a cold and a warm-started interpreter must agree on.

argv[1]: output directory; writes probe_<RANK>_<restart>.json. Rank 1 of restarts
below ``$PROBE_FAILS`` (default 1) then exits 3 once rank 0 wrote its probe (so the
agent restarts the group, warm when --warm-start is on); with ``--raise`` every
worker raises ValueError after writing instead. ``$PROBE_NUMPY``: record a draw of numpy's
global generator. ``$PROBE_SLEEP``: the workers of the restart that does not fail
sleep (up to 120 s) instead of exiting.
"""
import json
import os
import pickle
import sys
import threading
import time


class Point:
    def __init__(self, x):
        self.x = x


main = sys.modules["__main__"]
doc = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "name": __name__,
    "file": globals().get("__file__"),
    "main_is_me": main.__dict__ is globals(),
    "spec": repr(globals().get("__spec__")) if __spec__ is None else __spec__.name,
    "package": globals().get("__package__"),
    "loader": type(globals().get("__loader__")).__name__,
    "cached": globals().get("__cached__"),
    "globals": sorted(k for k in globals() if k.startswith("__")),
    "pickle": pickle.loads(pickle.dumps(Point(7))).x,
    "write_through": getattr(sys.stdout, "write_through", None),
    "flags": list(sys.flags),
    "pid": os.getpid(),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),  # Linux: this (the main) thread's; a spare imports at 19
    # the nice value of this process's autogroup (its session's scheduling group; None: no autogroups here)
    "autogroup": (open("/proc/self/autogroup").read().split()[-1] if os.path.exists("/proc/self/autogroup")
                  else None),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0"),  # the real exec'd argv
    "ppid": os.getppid(),
    "main_thread": threading.current_thread() is threading.main_thread(),
    "sid": os.getsid(0),
}
if os.environ.get("PROBE_NUMPY"):
    import numpy

    doc["np"] = int(numpy.random.randint(2**31))
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
path = os.path.join(sys.argv[1], f"probe_{rank}_{restart}.json")
with open(path + ".tmp", "w") as f:  # whole or absent: rank 1 exits as soon as it sees rank 0's
    json.dump(doc, f)
os.replace(path + ".tmp", path)
if "--raise" in sys.argv:
    raise ValueError(f"probe failure on purpose (rank {rank})")

if int(restart) < int(os.environ.get("PROBE_FAILS", "1")) and rank == "1":
    deadline = time.monotonic() + 60  # let rank 0 write its probe before the group is stopped
    while not os.path.exists(os.path.join(sys.argv[1], f"probe_0_{restart}.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
if os.environ.get("PROBE_SLEEP") and int(restart) >= int(os.environ.get("PROBE_FAILS", "1")):
    time.sleep(120)
