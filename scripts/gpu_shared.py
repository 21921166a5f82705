"""Run a training script with several ranks sharing one GPU under NCCL (the one-GPU device check).

``elaunch --standalone --nproc-per-node=2 scripts/gpu_shared.py SCRIPT [ARGS...]``

NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"). It tells hosts
apart by ``NCCL_HOSTID`` where that is set, so where the node has fewer GPUs than ranks
(``LOCAL_WORLD_SIZE``) this sets it to one of this rank's own (``<hostname>-rank<LOCAL_RANK>``);
then it runs ``SCRIPT`` as ``__main__`` with ``ARGS``. NCCL takes each rank for a host of its own
and connects them with its network transport (sockets: set ``NCCL_SOCKET_IFNAME=lo`` on a machine
without another interface). The script must pick ``cuda:LOCAL_RANK`` modulo the GPUs there are,
as ``examples/ddp_digits.py``, ``examples/fsdp2_dcp.py`` and the in-process benchmark's worker
do. A test aid for one-GPU machines, not a way to train.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: gpu_shared.py SCRIPT [ARGS...]")
    import torch

    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        os.environ["NCCL_HOSTID"] = f"{os.uname().nodename}-rank{os.environ.get('LOCAL_RANK', '0')}"
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
