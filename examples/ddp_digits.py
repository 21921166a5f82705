"""DistributedDataParallel training of a small MLP on scikit-learn's digits dataset.

Runs unchanged under ``torchrun`` and ``elaunch``::

    torchrun --standalone --nproc-per-node=2 examples/ddp_digits.py
    elaunch  --standalone --nproc-per-node=2 examples/ddp_digits.py

Data: ``sklearn.datasets.load_digits`` (1,797 8x8 images bundled with
scikit-learn, no download), split 80/20 with a fixed seed, features scaled.
Backend: gloo on CPU, nccl when CUDA is available (device ``cuda:LOCAL_RANK``).

Rank 0 writes a checkpoint atomically after every epoch and every rank loads it
on start, so a restarted group resumes where it stopped. ``--crash-rank R
--crash-epoch E`` makes rank R raise at the start of epoch E on the first attempt
only (``TORCHELASTIC_RESTART_COUNT == 0``); with ``--max-restarts >= 1`` the
launcher restarts the group, which resumes from the checkpoint of epoch E-1.

Output (rank 0): one line per epoch, ``epoch 3/20 loss 0.123 test_acc 0.961
restart 0``, then ``final test accuracy: 0.97``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from elaunch.errors import record
except ImportError:  # elaunch not installed: torch's decorator writes the same file
    from torch.distributed.elastic.multiprocessing.errors import record

CHECKPOINT_FORMAT = "elaunch-example-ddp_digits/1"
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20, help="epochs to train (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=64, help="hidden layer width (default 64)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="directory for the checkpoint (default ./runs/ddp_digits-$TORCHELASTIC_RUN_ID)",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint path (default RUN_DIR/checkpoint.pt)")
    p.add_argument("--crash-rank", type=int, default=None, help="global rank that crashes once")
    p.add_argument("--crash-epoch", type=int, default=None, help="epoch (1-based) at whose start it crashes")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs={args.epochs}: must be >= 1")
    if (args.crash_rank is None) != (args.crash_epoch is None):
        p.error("--crash-rank and --crash-epoch go together")
    if args.checkpoint is None:
        run_dir = args.run_dir or os.path.join(
            "runs", f"ddp_digits-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
        )
        args.checkpoint = os.path.join(run_dir, "checkpoint.pt")
    return args


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (x_train, y_train, x_test, y_test); identical on every rank (fixed seed)."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=SEED, stratify=digits.target
    )
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(np.asarray(a), dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def load_checkpoint(path: str) -> dict | None:
    """Return the checkpoint at ``path`` or None if there is none.

    Raises:
        SystemExit: the file exists but is not this example's checkpoint (we refuse
            to resume from, and later overwrite, an unrelated file).
    """
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise SystemExit(f"--checkpoint {path}: not readable as a checkpoint ({exc}); refusing to overwrite it")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"--checkpoint {path}: not a ddp_digits checkpoint; refusing to overwrite it")
    return state


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` atomically: a temporary file in the same directory, then ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fp:
            torch.save(state, fp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return (pred == y).float().mean().item()


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # Read (and vet) the checkpoint before joining the group: a bad path fails fast.
    state = load_checkpoint(args.checkpoint)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(SEED)

    x_tr, y_tr, x_te, y_te = load_data()
    x_te, y_te = x_te.to(device), y_te.to(device)
    train = TensorDataset(x_tr, y_tr)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
    # Every rank read the file; make sure all start from rank 0's epoch.
    epoch_t = torch.tensor([start_epoch], device=device)
    dist.broadcast(epoch_t, src=0)
    start_epoch = int(epoch_t.item())
    if rank == 0 and state is not None:
        print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)  # broadcasts rank 0's weights
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(start_epoch + 1, args.epochs + 1):
        if restart == 0 and epoch == args.crash_epoch:
            # every rank waits here until rank 0 has saved the last epoch's checkpoint,
            # so the injected crash cannot cut that save short
            dist.barrier()
            if rank == args.crash_rank:
                raise RuntimeError(f"injected crash: rank {rank} at epoch {epoch} (--crash-rank/--crash-epoch)")
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)  # sum of losses, number of samples
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(yb), torch.tensor(float(len(yb)), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            acc = accuracy(model, x_te, y_te)
            print(
                f"epoch {epoch}/{args.epochs} loss {(total[0] / total[1]).item():.3f} "
                f"test_acc {acc:.3f} restart {restart}",
                flush=True,
            )
            save_checkpoint(
                args.checkpoint,
                {
                    "format": CHECKPOINT_FORMAT,
                    "epoch": epoch,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                },
            )

    if rank == 0:
        print(f"final test accuracy: {accuracy(model, x_te, y_te):.2f}", flush=True)
    dist.barrier()
    # DDP's reducer holds the process group (in reference cycles): free it now, so the
    # group's C++ threads are torn down here and not during interpreter shutdown,
    # where gloo can abort ("terminate called without an active exception").
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
