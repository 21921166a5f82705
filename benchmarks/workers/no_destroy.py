"""A gloo worker that never calls ``destroy_process_group()`` (as PyTorch's own init-method test scripts).

It initialises the default group from ``env://``, all-reduces once and returns.
That sometimes ends in "terminate called without an active exception" (SIGABRT),
failing the job, under any launcher: gloo's worker thread still has to release
the all-reduced tensor (which needs the GIL) when the main thread is already
shutting the interpreter down (see docs/migrating-from-torchrun.md).
"""
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
