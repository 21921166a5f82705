"""Worker of the exit-rate test: PyTorch's init-method test script, in this suite's words.

As ``test/distributed/launcher/bin/test_script_init_method.py`` run by
``test_init_method_env_with_torchelastic``: join a gloo world from ``env://``,
all-reduce a one-hot of this rank, check the sum is the world size, print
``Done`` and return, never calling ``destroy_process_group()``.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--init-method", default="env://")  # the upstream test passes --init-method=env://
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(backend="gloo", init_method=parser.parse_args().init_method, rank=rank,
                        world_size=world_size)
t = F.one_hot(torch.tensor(rank), num_classes=world_size)
dist.all_reduce(t)
derived = torch.sum(t).item()
if derived != world_size:
    raise RuntimeError(f"derived world size {derived} != {world_size}")
print("Done")
