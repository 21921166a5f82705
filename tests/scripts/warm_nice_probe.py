"""A module for --warm-start-modules: at import, writes the importing thread's nice value and its
process's autogroup's (``<thread> <autogroup>``; ``-`` for the second where the kernel has no autogroups).

Into ``$WARM_NICE_OUT/<pid>`` (when that variable is set); a spare imports it in its
low-priority import thread (``elaunch.procs._warm_child``).
"""
import os

_out = os.environ.get("WARM_NICE_OUT")
if _out:
    _group = "-"
    if os.path.exists("/proc/self/autogroup"):
        with open("/proc/self/autogroup") as _f:
            _group = _f.read().split()[-1]  # "/autogroup-<id> nice <n>"
    with open(os.path.join(_out, str(os.getpid())), "w") as _f:
        _f.write(f"{os.getpriority(os.PRIO_PROCESS, 0)} {_group}")  # Linux: the calling thread's
if os.environ.get("WARM_NICE_NUMPY"):  # a module that draws from numpy's global generator at import
    import numpy

    numpy.random.random()

import threading  # noqa: E402

threading.current_thread()  # as torch does: threading then keeps an entry for the importing thread
