"""The agent process's heap: its start-up objects kept out of the garbage collector's way.

An agent imports torch (for the c10d store) and builds its handler before the
first rendezvous: ~170,000 container objects that live as long as the process.
CPython's cyclic collector walks all of them in every full collection; at 1024
nodes a decode of the rendezvous state (117 KB, done every poll) allocates
enough containers to keep them coming (one per ~200 decodes, ~40 ms of CPU
each, on this machine). ``gc.freeze()`` moves what exists at start-up into the
permanent generation, as CPython's documentation suggests for long-lived servers, so
collections walk only what the agent allocated since. Objects frozen are still
freed when their last reference goes; only cycles among them are never
collected, and start-up leaves none worth finding.

Only the ``elaunch`` command freezes its heap (``elaunch.launch.launch``): the
Python API (``elaunch.run.run``, ``elaunch.launcher``) runs in the caller's
process, whose heap is not ours to freeze. torchrun's agent does not do this.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object the collector tracks now into its permanent generation.

    Call once, when start-up (imports, the rendezvous handler, the agent) is done
    and before the first rendezvous. Costs well under a millisecond (no collection);
    ``gc.get_freeze_count()`` tells how many objects are frozen.
    """
    gc.freeze()
