"""A worker that saves or loads ``elaunch.checkpoint`` snapshots: ``ckpt_roundtrip.py save STEP... | loop FROM | load``.

``save STEP...``: saves :func:`make_state` of each step and prints ``saved STEP`` once
committed. ``loop FROM``: saves steps FROM, FROM+1, ... forever (until killed).
``load``: ``ckpt.load()`` and prints one JSON line: ``{"step": S, "equal": bool}`` (``equal``:
the state is bit-identical, container types included, to ``make_state(S)``), or
``{"step": null}``; a ``CheckpointError`` or ``UnsafeStateError`` prints ``{"error": "...", "class": ...}``
and exits 3.
With ``CKPT_DIST=1`` it first joins a gloo group (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``). ``CKPT_STATE_RANK`` (default ``RANK``) seeds the state. ``CKPT_MIB`` sets
the size of the big tensors (default 1 MiB in all). ``CKPT_SHARDED=1``: ``replicated=False``.
``CKPT_CYCLE=N``: step S saves ``make_state(S % N)``, made once (a loop then spends its time copying).
The state holds a namedtuple of this module (``Pair``), allowed for weights-only loading with
``torch.serialization.add_safe_globals`` on import, unless ``CKPT_NO_ALLOW=1``.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys

Pair = collections.namedtuple("Pair", "left right")


def _allow() -> None:
    """Let weights-only loading rebuild :class:`Pair` (a user's class) in this process, saver or loader."""
    import torch

    torch.serialization.add_safe_globals([Pair])


if os.environ.get("CKPT_NO_ALLOW") != "1":  # CKPT_NO_ALLOW=1: a loader that did not allow Pair
    _allow()


def make_state(step: int, rank: int = 0, mib: float | None = None):
    """A deterministic state of ``step``: many dtypes, strided views, nested containers of each kind."""
    import torch

    mib = float(os.environ.get("CKPT_MIB", "1")) if mib is None else mib
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    n = max(int(mib * (1 << 20)) // 4 // 8, 1)
    big = [torch.randn(n, generator=gen) for _ in range(8)]
    base = torch.randn(16, 12, generator=gen, dtype=torch.float64)
    shared = torch.randn(5, generator=gen)
    return {
        "model": collections.OrderedDict(
            big=big,
            bf16=torch.randn(33, 7, generator=gen).to(torch.bfloat16),
            fp16=torch.randn(9, generator=gen).to(torch.float16),
            i8=torch.randint(-128, 127, (31,), generator=gen, dtype=torch.int8),
            i64=torch.randint(0, 2**62, (3, 3), generator=gen, dtype=torch.int64),
            mask=torch.rand(17, generator=gen) > 0.5,
            cplx=torch.randn(4, generator=gen, dtype=torch.complex64),
            transposed=base.t(),
            strided=base[::3, 1::2],
            scalar=torch.tensor(step, dtype=torch.int32),
            empty=torch.empty(0, 3),
            shared=shared,
            same=shared,
        ),
        "optim": {"param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999), "params": [0, 1]}],
                  "state": {0: {"exp_avg": torch.randn(6, generator=gen)}}},
        "pair": Pair(torch.ones(2) * step, "x"),
        "leaves": [step, 2.5, "text", None, True, b"bytes", (1, (2, [3]))],
    }


def same(a, b) -> bool:
    """Bit-identical: types, dtypes, shapes and bytes of every part."""
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _load() -> int:
    import elaunch.checkpoint as ckpt

    if os.environ.get("CKPT_DIST") == "1":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        snap = ckpt.load()
    except (ckpt.CheckpointError, ckpt.UnsafeStateError) as exc:
        print(json.dumps({"error": str(exc), "class": type(exc).__name__}), flush=True)
        return 3
    if snap is None:
        print(json.dumps({"step": None}), flush=True)
        return 0
    rank = int(os.environ.get("CKPT_STATE_RANK", os.environ.get("RANK", "0")))
    state = snap.state
    ok = same(state, make_state(snap.step, rank)) and state["model"]["shared"] is state["model"]["same"]
    print(json.dumps({"step": snap.step, "equal": ok}), flush=True)
    return 0


def main() -> int:
    import elaunch.checkpoint as ckpt

    what, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    rank = int(os.environ.get("CKPT_STATE_RANK", os.environ.get("RANK", "0")))
    if what == "load":
        return _load()
    steps = itertools.count(args[0]) if what == "loop" else args
    cycle = int(os.environ.get("CKPT_CYCLE", "0"))
    states = {}
    for step in steps:
        key = step % cycle if cycle else step
        state = states.get(key) or make_state(key, rank)
        if cycle:
            states[key] = state
        ckpt.save(state, step, replicated=os.environ.get("CKPT_SHARDED") != "1")
        print(f"saved {step}", flush=True)
    return 0


if __name__ == "__main__":
    import ckpt_roundtrip  # states pickle Pair as ckpt_roundtrip.Pair, which the test process imports too

    sys.exit(ckpt_roundtrip.main())
