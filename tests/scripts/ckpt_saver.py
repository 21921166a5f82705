"""A worker that saves snapshots when told: ``ckpt_saver.py MIB [sharded] [marker]``, one per local rank.

Runs as a worker would under elaunch (``ELAUNCH_CHECKPOINT_SHM``, ``LOCAL_RANK``,
``RANK``, ``WORLD_SIZE`` in its environment). Prints ``ready`` once torch is
imported, then reads lines from stdin: ``save STEP`` saves :func:`make_state` of
that step (with a :class:`Marker` under ``marker``) with ``elaunch.checkpoint.save`` (replicated
unless ``sharded``) and prints
``saved STEP`` once it is committed. End of input: exit.
"""

from __future__ import annotations

import collections
import os
import sys


def make_state(step: int, rank: int, mib: float):
    """A deterministic state of about ``mib`` MiB for ``step`` and ``rank``: what the tests compare against."""
    import torch

    gen = torch.Generator().manual_seed(step * 1000 + rank)
    n = max(int(mib * (1 << 20)) // 4, 16)
    return {
        "model": collections.OrderedDict(
            weight=torch.randn(n, generator=gen),
            half=torch.randn(64, 3, generator=gen).to(torch.bfloat16),
            count=torch.tensor([step, rank], dtype=torch.int64),
        ),
        "optim": {"param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999)}], "state": {}},
        "step": step,
        "note": f"rank {rank} step {step}",
    }


class Marker:
    """A leaf of a class only this script defines (``__main__.Marker``), allowed here for weights-only
    loading: the persister, which has not allowed it (nor could import it), cannot unpickle it."""

    def __init__(self, step: int) -> None:
        self.step = step


def main(mib: float, *modes: str) -> int:
    import torch

    import elaunch.checkpoint as ckpt

    torch.serialization.add_safe_globals([Marker])  # the saver trusts it (the save checks that it would load)
    rank = int(os.environ["RANK"])
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["save"]:
            step = int(words[1])
            state = make_state(step, rank, mib)
            if "marker" in modes:
                state["marker"] = Marker(step)
            ckpt.save(state, step, replicated="sharded" not in modes)
            print(f"saved {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]), *sys.argv[2:]))
