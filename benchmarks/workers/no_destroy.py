"""A gloo worker that never calls ``destroy_process_group()`` (as PyTorch's own init-method test scripts).

It initialises the default group from ``env://``, all-reduces once and returns.
At interpreter exit the process group and the store client are torn down with
the rest; with the worker-side store of rank 0 that sometimes ends in
"terminate called without an active exception" (SIGABRT), failing the job.
"""
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
