"""A tiny Lightning training for elaunch.lightning: 2 CPU ranks, a checkpoint after every step, optionally a SIGKILL.

``lightning_fit.py OUT --steps N [--kill-at K] [--strategy ddp|fsdp] [--disk]``, run by
``elaunch --standalone --nproc-per-node=2 [--max-restarts=1]``.

The batch of step ``s`` on rank ``r`` is drawn from a generator seeded with ``(s, r)``, not
from the data loader, so a run that resumes at step ``s`` sees the batches an uninterrupted
run sees (whatever Lightning does with the loader's position on a resume).

Each rank of each attempt writes ``OUT/attempt<A>_rank<R>.json``: ``start_step`` (the
``global_step`` at ``on_train_start``, after any restore), ``start_digest`` (the SHA-256 of the
full parameters then), ``dtensors`` (every parameter a DTensor: ``--strategy fsdp``, FSDP2 through
``SnapshotModelParallelStrategy``), ``digests`` (``{step: digest}`` at the start of each batch), ``restored``
(the plugin's ``restored``), ``resume`` (what ``resume_path()`` returned). At the end rank 0
writes ``OUT/final.json``: ``{"digest", "global_step"}``. On attempt 0, with ``--kill-at K``,
rank 1 SIGKILLs itself at the start of the batch at ``global_step == K`` (after the checkpoint of
step K was saved: ``ModelCheckpoint`` saves at the end of a batch, and the save ends with a barrier).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from elaunch.lightning import SnapshotCheckpointIO, resume_path

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--disk", action="store_true", help="the plugin also writes .ckpt files (TorchCheckpointIO)")
    return p.parse_args()


def full_params(module: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in module.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.contiguous().cpu())
    return out


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for t in full_params(module):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class Tiny(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.record: dict = {"attempt": ATTEMPT, "digests": {}}

    def configure_model(self) -> None:
        if self.args.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(10_000, 1)), batch_size=1)

    def on_train_start(self) -> None:
        self.record["start_step"] = self.global_step
        self.record["start_digest"] = digest(self)
        self.record["dtensors"] = all(hasattr(p, "full_tensor") for p in self.parameters())

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.record["digests"][str(self.global_step)] = digest(self)
        self._write()
        if ATTEMPT == 0 and self.global_rank == 1 and self.global_step == self.args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def _write(self) -> None:
        path = os.path.join(self.args.out, f"attempt{ATTEMPT}_rank{self.global_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.record, f)
        os.replace(path + ".tmp", path)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = Tiny(args)
    disk = None
    if args.disk:
        from lightning.fabric.plugins import TorchCheckpointIO

        disk = TorchCheckpointIO()
    io = SnapshotCheckpointIO(disk)
    if args.strategy == "ddp":
        strategy, plugins = "ddp", [io]
    else:
        from elaunch.lightning import SnapshotModelParallelStrategy

        strategy, plugins = SnapshotModelParallelStrategy(), []
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, plugins=plugins,
                        max_steps=args.steps, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        default_root_dir=os.path.join(args.out, "root"),
                        callbacks=[ModelCheckpoint(every_n_train_steps=1)])
    resume = resume_path()
    model.record["resume"] = resume
    trainer.fit(model, ckpt_path=resume)
    model.record["restored"] = io.restored if args.strategy == "ddp" else strategy.restored
    model._write()
    final = digest(model)
    if trainer.global_rank == 0:
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump({"digest": final, "global_step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (a known torch/gloo race at exit: SIGABRT)
