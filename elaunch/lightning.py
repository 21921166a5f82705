"""Lightning integration: a Lightning run's checkpoints as elaunch in-memory snapshots, and a resume from them.

One line for DDP (and any strategy whose checkpoints go through Lightning's ``CheckpointIO``)::

    from elaunch.lightning import SnapshotCheckpointIO, resume_path

    trainer = L.Trainer(strategy="ddp", plugins=[SnapshotCheckpointIO()],
                        callbacks=[ModelCheckpoint(every_n_train_steps=1)])
    trainer.fit(model, ckpt_path=resume_path())   # None on a fresh start: Lightning starts from scratch

Every checkpoint Lightning saves (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes
a ``elaunch.checkpoint.save`` of the whole checkpoint dict at its ``global_step``; after a
restart, :func:`resume_path` names the snapshot the job agreed on, which the plugin's
``load_checkpoint`` returns to Lightning in place of a file.

Sharded strategies: Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) and
``FSDPStrategy`` with ``state_dict_type="sharded"`` write through
``torch.distributed.checkpoint`` themselves and never call a ``CheckpointIO``. For
``ModelParallelStrategy`` use :class:`SnapshotModelParallelStrategy`, which saves through
DCP with :class:`elaunch.checkpoint.SnapshotWriter` and loads with
:class:`elaunch.checkpoint.SnapshotReader`.

Needs the ``lightning`` package (2.x; not the older ``pytorch_lightning`` name): elaunch
itself never imports this module.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("elaunch.lightning needs the `lightning` package (pip install lightning)") from exc

import elaunch.checkpoint as ckpt

__all__ = ["RESUME", "SnapshotCheckpointIO", "SnapshotModelParallelStrategy", "resume_path"]

#: The ``ckpt_path`` that names "the snapshot the job agreed on"; what :func:`resume_path` returns.
RESUME = "elaunch://snapshot"


def _is_resume(path: Any) -> bool:
    return isinstance(path, str) and path == RESUME


def resume_path(fallback: str | os.PathLike | None = None) -> str | os.PathLike | None:
    """The ``ckpt_path`` for ``trainer.fit``: :data:`RESUME` when there is a snapshot to resume from, else ``fallback``.

    Under elaunch there is one when the agent chose a snapshot for this round
    (``ELAUNCH_CHECKPOINT_RESTORE`` set: the same step on every rank, from memory, a peer or
    ``--checkpoint-dir``). Without elaunch (torchrun, no launcher) when
    ``ELAUNCH_CHECKPOINT_DIR`` (default ``./elaunch_checkpoints``) holds a complete step.
    Call it before ``trainer.fit``; it reads only the environment and the directory, no
    process group is needed.

    Args:
        fallback: what to return when there is nothing to resume from: None (a fresh start,
            Lightning's meaning of ``ckpt_path=None``), or a path or ``"last"`` to resume
            from a disk checkpoint instead.

    Returns:
        :data:`RESUME` (a ``str``; only :class:`SnapshotCheckpointIO` and
        :class:`SnapshotModelParallelStrategy` understand it) or ``fallback``.
    """
    if os.environ.get("ELAUNCH_CHECKPOINT_SHM"):
        return RESUME if os.environ.get("ELAUNCH_CHECKPOINT_RESTORE") else fallback
    from elaunch.checkpoint import _local, persisted

    d = _local.directory()
    if persisted.newest_complete(d) is not None or _newest_dcp(d) is not None:
        return RESUME
    return fallback


def _newest_dcp(d: str):
    from elaunch.checkpoint import persisted

    return persisted.newest_dcp(d) if os.path.isdir(os.path.join(d, "dcp")) else None


class SnapshotCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint as an elaunch in-memory snapshot.

    ``Trainer(plugins=[SnapshotCheckpointIO()])``. It takes the place of Lightning's
    ``TorchCheckpointIO`` (a ``torch.save`` of the checkpoint dict to ``path``):

    * ``save_checkpoint(checkpoint, path)`` calls ``elaunch.checkpoint.save(checkpoint,
      step=checkpoint["global_step"], replicated=...)``: it returns once the snapshot is
      committed in the agent's shared memory (a memory copy; no disk write), which the
      agent replicates and persists. Lightning calls it on global rank 0 only (DDP's
      state is the same on every rank); a replicated snapshot of one rank restores every
      rank, at any world size. ``path`` is not written unless ``checkpoint_io`` is given.
    * ``load_checkpoint(RESUME)`` returns the snapshot's checkpoint dict, the step the
      whole job agreed on (see :func:`resume_path`); any other path goes to
      ``checkpoint_io`` (by default ``TorchCheckpointIO``: a Lightning ``.ckpt`` file).
    * ``remove_checkpoint(path)`` removes only what ``checkpoint_io`` wrote: the agent's
      two slots per rank already hold no more than the two newest snapshots.

    Without elaunch (torchrun, no launcher) the snapshots are ``torch.save`` files in
    ``ELAUNCH_CHECKPOINT_DIR``, written synchronously, as ``ckpt.save`` does.

    Args:
        checkpoint_io: None (snapshots only), or a ``CheckpointIO`` (``TorchCheckpointIO()``,
            ``AsyncCheckpointIO()``...) that also writes each checkpoint to ``path`` on disk,
            after the snapshot, and serves ``load_checkpoint`` for real paths.
        replicated: passed to ``ckpt.save``: True (the default) for strategies whose
            checkpoint is the same on every rank and saved by rank 0 (DDP, single device,
            ``FSDPStrategy(state_dict_type="full")``); False only for a strategy that calls
            ``save_checkpoint`` on every rank with its own state.

    Attributes:
        restored: after a load from a snapshot, ``{"step": int, "source": str}`` (source:
            the file the agent chose, ``ELAUNCH_CHECKPOINT_RESTORE``, or ``"local"``
            without elaunch); else None.

    Raises (from ``save_checkpoint``):
        TypeError: a value of the checkpoint cannot be saved or would not load weights-only
            (a class of your own in ``hyper_parameters``: allow it with
            ``torch.serialization.add_safe_globals``); the message names its key path.
        elaunch.checkpoint.SnapshotTooLarge: the checkpoint does not fit the free shared memory.
        KeyError: the checkpoint has no ``global_step`` (not a Lightning checkpoint).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, *, replicated: bool = True) -> None:
        super().__init__()
        self.checkpoint_io = checkpoint_io
        self.replicated = replicated
        self.restored: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        ckpt.save(checkpoint, step=int(checkpoint["global_step"]), replicated=self.replicated)
        if self.checkpoint_io is not None:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict of the snapshot the job agreed on (``path`` is :data:`RESUME`), or of the file ``path``.

        Tensors land on the CPU unless ``map_location`` says otherwise (as with
        ``TorchCheckpointIO``); Lightning moves them. A snapshot is always loaded
        weights-only, whatever ``weights_only`` says.

        Raises:
            FileNotFoundError: ``path`` is :data:`RESUME` and there is no snapshot to resume
                from (what ``TorchCheckpointIO`` raises for a missing file).
            elaunch.checkpoint.CheckpointError: the snapshot the agent chose cannot be read.
            elaunch.checkpoint.UnsafeStateError: it needs a class weights-only loading does not allow.
        """
        if not _is_resume(path):
            io = self.checkpoint_io or TorchCheckpointIO()
            if map_location is None:
                return io.load_checkpoint(path, weights_only=weights_only)
            return io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        snap = ckpt.load(map_location if map_location is not None else _cpu)
        if snap is None:
            raise FileNotFoundError(f"{RESUME}: no elaunch snapshot to resume from (call resume_path(), which "
                                    f"returns None on a fresh start)")
        self.restored = {"step": snap.step, "source": os.environ.get("ELAUNCH_CHECKPOINT_RESTORE") or "local"}
        return snap.state

    def remove_checkpoint(self, path: Any) -> None:
        if self.checkpoint_io is not None and not _is_resume(path):
            self.checkpoint_io.remove_checkpoint(path)

    def teardown(self) -> None:
        if self.checkpoint_io is not None:
            self.checkpoint_io.teardown()


def _cpu(storage, location):
    return storage



class SnapshotModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) with its checkpoints in elaunch's memory.

    ``Trainer(strategy=SnapshotModelParallelStrategy(...))`` in place of
    ``ModelParallelStrategy(...)`` (same arguments). Lightning's strategy writes a DCP
    directory itself (``torch.distributed.checkpoint.save(..., checkpoint_id=path)``) and
    refuses a ``CheckpointIO``; this one overrides its ``save_checkpoint`` and
    ``load_checkpoint`` only:

    * ``save_checkpoint(checkpoint, path)`` (on every rank, as Lightning calls it) saves the
      sharded ``state_dict`` and ``optimizer_<i>`` states through ``dcp.save`` with
      :class:`elaunch.checkpoint.SnapshotWriter` at ``checkpoint["global_step"]``, and the rest
      of the checkpoint (loops, callbacks, ``global_step``...; what Lightning puts in
      ``meta.pt``) as a ``torch.save`` byte string in a ``uint8`` tensor ``lightning_meta``,
      rank 0's on every rank. ``path`` is not written.
    * ``load_checkpoint(RESUME)`` loads them back with ``dcp.load`` and
      :class:`elaunch.checkpoint.SnapshotReader` (resharded by DCP when the world size
      changed), the metadata weights-only; another path loads as Lightning's does.

    Needs ``save_distributed_checkpoint=True`` (Lightning's default); full state gathered on
    rank 0 (False) is not supported.

    Attributes:
        restored: after a load from snapshots, ``{"step": int, "source": "memory" or "disk"}``; else None.

    Raises:
        ValueError: ``save_distributed_checkpoint=False``.
        TypeError: ``storage_options`` given (as Lightning's strategy).
        FileNotFoundError: ``load_checkpoint(RESUME)`` with no snapshot to resume from.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(f"{type(self).__name__} saves sharded state only: save_distributed_checkpoint=True "
                             f"(Lightning's default), not False")
        self.restored: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported")
        step = int(checkpoint["global_step"])
        import io

        import torch
        import torch.distributed.checkpoint as dcp

        from elaunch.checkpoint import SnapshotWriter

        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        meta = self.broadcast(buf.getvalue())  # one value for the job: a plain tensor is the same on every rank in DCP
        state["lightning_meta"] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        dcp.save(state, storage_writer=SnapshotWriter(step=step))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not _is_resume(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        import io

        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)

        from elaunch.checkpoint import SnapshotReader

        reader = SnapshotReader()
        if reader.step is None:
            raise FileNotFoundError(f"{RESUME}: no elaunch snapshot to resume from")
        size = reader.read_metadata().state_dict_metadata["lightning_meta"].size
        optimizers = list(self.optimizers)
        state = {"state_dict": get_model_state_dict(self.model),
                 **{f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(optimizers)},
                 "lightning_meta": torch.empty(size, dtype=torch.uint8)}
        dcp.load(state, storage_reader=reader)
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))
        for i, o in enumerate(optimizers):
            set_optimizer_state_dict(self.model, o, optim_state_dict=state[f"optimizer_{i}"])
        meta = torch.load(io.BytesIO(state["lightning_meta"].numpy().tobytes()), weights_only=True)
        self.restored = {"step": reader.step, "source": reader.source}
        return meta
