"""In-memory checkpoints: ``save`` a training state into memory the elaunch agent keeps, ``load`` it back.

::

    import elaunch.checkpoint as ckpt

    snap = ckpt.load()                      # Snapshot(step, state) or None
    if snap is not None:
        model.load_state_dict(snap.state["model"]); start = snap.step + 1
    for step in range(start, steps):
        ...
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)

Under elaunch (``ELAUNCH_CHECKPOINT_SHM`` set by the agent) a save copies the state into
one of its local rank's two slot files in the agent's ``/dev/shm`` directory and commits
it (:mod:`elaunch.checkpoint.slotfile`): a worker killed during a copy leaves its previous
snapshot whole. The agent persists, replicates and restores it; ``load`` reads the file the
agent chose for this round (``ELAUNCH_CHECKPOINT_RESTORE``) at the step the whole job
agreed on (``ELAUNCH_CHECKPOINT_STEP``).

Without it (torchrun, no launcher) the same calls write and read the persisted layout
(:mod:`elaunch.checkpoint.persisted`) in ``ELAUNCH_CHECKPOINT_DIR`` (default
``./elaunch_checkpoints``), synchronously: a script needs no branch.

torch is imported inside the functions: the (torch-free) agent imports
``elaunch.checkpoint.slotfile``, which imports this package.
"""

from __future__ import annotations

import operator
import os
import pickle
from typing import Any, NamedTuple

__all__ = ["Snapshot", "CheckpointError", "UnsafeStateError", "SnapshotTooLarge", "save", "load", "read_slot",
           "SnapshotWriter", "SnapshotReader"]


def __getattr__(name: str):
    """``SnapshotWriter`` and ``SnapshotReader`` (``elaunch.checkpoint.dcp``), imported on first use: they import
    torch and ``torch.distributed.checkpoint``, which the agent (that imports this package) must not."""
    if name in ("SnapshotWriter", "SnapshotReader"):
        from elaunch.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Snapshot(NamedTuple):
    """A restored snapshot.

    Attributes:
        step: the step given to :func:`save`.
        state: the state, with its container types; tensors are fresh copies, or the
            very tensors of :func:`load`'s ``into`` that received the saved values.
    """

    step: int
    state: Any


class CheckpointError(RuntimeError):
    """A snapshot cannot be restored: missing, another step than the job agreed on, or changed while read."""


class UnsafeStateError(pickle.UnpicklingError):
    """A snapshot or persisted file needs a class that weights-only loading does not allow; nothing of it ran.

    Loading unpickles as ``torch.load(weights_only=True)`` does (torch's weights-only
    unpickler): tensors, primitive types, containers, the types torch allows and the
    classes in ``torch.serialization.get_safe_globals()``. The message names the class
    (``mypkg.config.TrainConfig``) and how to allow it:
    ``torch.serialization.add_safe_globals([TrainConfig])`` before ``load``, or the
    ``torch.serialization.safe_globals([...])`` context manager around it. It is a
    ``pickle.UnpicklingError``, what ``torch.load(weights_only=True)`` raises, and not a
    ``CheckpointError``: that one says "this source cannot serve, another may" (the
    agent's persister skips a slot that raises it), while a state that needs a class
    not allowed is refused from every source, and must be seen.
    """


class SnapshotTooLarge(OSError):
    """The snapshot does not fit the free shared memory (``errno`` is ENOSPC); nothing was overwritten."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _ranks() -> dict[str, int]:
    return {"rank": _env_int("RANK", 0), "world_size": _env_int("WORLD_SIZE", 1)}


def save(state: Any, step: int, *, replicated: bool = True) -> None:
    """Save ``state`` as the snapshot of ``step``; return once it is committed.

    Under elaunch the tensors are copied into shared memory (CUDA tensors through
    page-locked memory), the step and a checksum last; the previous snapshot stays
    whole until this one is committed. Elsewhere the state is written with ``torch.save``
    to ``ELAUNCH_CHECKPOINT_DIR`` (temporary file, fsync, rename).

    Args:
        state: a nested dict (dict, OrderedDict), list or tuple of tensors (dense, CPU or
            CUDA; non-contiguous ones are fine), numbers, strings, bytes, None, sets, and
            objects of the types ``torch.load(weights_only=True)`` loads: what
            ``state_dict()`` returns. A class of your own (a dataclass, an enum, a
            namedtuple, a dict subclass) must be allowed with
            ``torch.serialization.add_safe_globals`` in the saving and the loading process.
        step: the training step (an int >= 0, or anything with ``__index__``); ``load`` returns it.
        replicated: True when every rank holds the same state (DDP): any rank's snapshot
            restores any rank, at any world size; a restore hands every rank the one
            snapshot chosen (the lowest rank's), so per-rank entries (an RNG state) come
            back as that rank's. False for per-rank state (one snapshot per rank, restored
            only at the same world size), and for DTensors (FSDP2's ``fully_shard``, tensor
            parallelism: ``model.state_dict()``, ``get_state_dict(model, optim)``): each rank
            saves its local shard (``to_local()``) with its placements (``Shard``,
            ``Replicate``, ``Partial``), the global shape and stride and its device mesh's
            shape, dimension names, ranks and device type, as
            ``torch.distributed.checkpoint.save`` keeps each rank's shards; ``load``
            makes them DTensors again at the same world size. ShardedTensors (the
            deprecated ``torch.distributed._shard``) are refused.

    Raises:
        TypeError: a leaf cannot be saved; the message names its key path, e.g.
            ``state['optimizer']['param_groups'][0]['fn']``. Nothing is written. Also
            raised when a leaf would not load weights-only (a class not allowed with
            ``torch.serialization.add_safe_globals``: checked when the state's pickled
            structure differs from the last one checked); for a DTensor leaf with
            ``replicated=True`` (a DTensor is not the same on every rank: save it with
            ``replicated=False``); for a ShardedTensor leaf, or a DTensor placed otherwise
            than ``Shard``, ``_StridedShard``, ``Replicate`` or ``Partial``.
        SnapshotTooLarge: the snapshot is larger than the free shared memory. Nothing is
            written; both slots keep what they held.
        CheckpointError: the agent's directory (``ELAUNCH_CHECKPOINT_SHM``) is gone.
        OSError: the checkpoint directory cannot be written (without elaunch).
        ValueError: ``step`` is not an integer from 0 to 2**63 - 1 (a snapshot's step is a signed 64-bit field).
    """
    from elaunch.checkpoint.slotfile import MAX_STEP

    if isinstance(step, bool) or not hasattr(step, "__index__") or not 0 <= operator.index(step) <= MAX_STEP:
        raise ValueError(f"step must be an int from 0 to 2**63 - 1, not {step!r}")
    step = operator.index(step)  # a numpy or 0-dim torch integer too
    shm = os.environ.get("ELAUNCH_CHECKPOINT_SHM")
    local_rank = _env_int("LOCAL_RANK", 0)
    if shm:
        from elaunch.checkpoint import _shm

        _shm.save(state, step, replicated=replicated, shm_dir=shm, local_rank=local_rank, **_ranks())
    else:
        from elaunch.checkpoint import _local

        _local.save(state, step, replicated=replicated, local_rank=local_rank, **_ranks())


def load(map_location=None, *, into: Any = None, mesh: Any = None) -> Snapshot | None:
    """The snapshot this worker resumes from, or None when there is none.

    Under elaunch: the file the agent chose (``ELAUNCH_CHECKPOINT_RESTORE``: a slot file
    or a persisted ``*.pt``), which must hold the step the job agreed on
    (``ELAUNCH_CHECKPOINT_STEP``). Elsewhere: the newest step complete in
    ``ELAUNCH_CHECKPOINT_DIR`` that every rank has (agreed with one ``all_reduce`` when
    ``torch.distributed`` is initialized).

    With ``into``, the restore is a copy into tensors that already exist, the way
    ``torch.distributed.checkpoint.load`` fills a state in place: no new memory to
    fault in page by page, which is most of a restore into new tensors (256 MiB from a
    slot on 2 cores: about 3x faster than into new tensors).

    ::

        snap = ckpt.load(into={"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        # the model's parameters and the optimizer's moments now hold the saved values

    DTensors (saved with ``replicated=False``) come back as DTensors, at the world size
    they were saved at only: each rank takes back its own shards, as
    ``torch.distributed.checkpoint.load`` does with an unchanged world. Into ``into``'s
    DTensors (an FSDP2 model's ``state_dict()``) when they fit: their local shards
    take the saved ones in place. The others are made with ``DTensor.from_local`` on
    the saved device mesh, rebuilt with ``init_device_mesh(device_type, shape,
    mesh_dim_names=...)`` (a mesh sliced from a larger one, ``mesh_2d["dp"]``: that one
    rebuilt, then sliced by name), or taken from ``mesh``. At another world size, load
    through ``torch.distributed.checkpoint`` with ``elaunch.checkpoint.SnapshotReader``,
    which reshards.

    Args:
        map_location: like ``torch.load``'s: None (each tensor where it was saved), a
            device string or ``torch.device``, a dict from saved device strings to
            device strings, or a function ``(storage, location) -> storage or None``
            (``lambda storage, loc: storage`` keeps everything on the CPU). Tensors
            copied into ``into`` stay where ``into``'s are.
        into: None, or a state of the structure that was saved (nested dicts, lists,
            tuples). Each saved tensor whose key path (``['model']['fc.weight']``,
            through dicts, lists and tuples) holds a dense tensor of the same shape and
            dtype in ``into`` (any device) is copied into that tensor, and the returned
            state holds that very object (not an ``nn.Parameter`` made anew, whatever
            was saved). Other tensors are restored fresh, as without ``into``. Without
            elaunch's shared memory the state is loaded as usual, then copied in. A
            saved DTensor goes into a DTensor there of the same global shape, dtype,
            placements and local shape on a mesh of the same shape and ranks: its
            local shard (``_local_tensor``) is filled, and the state holds that very
            DTensor (or the ``nn.Parameter`` that is one).
        mesh: None, or a ``DeviceMesh`` (or a list of them) for DTensors not loaded
            into ``into``: each takes the one whose device type, shape, dimension names
            and ranks are those of the mesh it was saved on, instead of a mesh rebuilt.
            Needed only for a mesh ``init_device_mesh`` does not rebuild (ranks in
            another order than ``0 .. world_size-1``, a flattened mesh).

    Returns:
        Snapshot or None (then ``into`` is untouched).

    Loading never runs code from the file: the structure is unpickled as
    ``torch.load(weights_only=True)`` does, whoever wrote the file (a snapshot may come
    from a peer node). A class of your own must be allowed first:
    ``torch.serialization.add_safe_globals([MyConfig])``.

    Raises:
        UnsafeStateError: the state needs a class weights-only loading does not allow;
            the message names it and how to allow it (a ``pickle.UnpicklingError``, as
            ``torch.load(weights_only=True)`` raises).
        CheckpointError: the file is missing or holds no commit, holds another step than
            the job agreed on, or was overwritten while it was read (then ``into``'s
            tensors may hold parts of two steps, or of a step and what they held: load
            again or do not use them); without elaunch, a sharded checkpoint saved at
            another world size. With DTensors: saved at another world size than this
            process's, or ``torch.distributed`` not initialized (the message says the
            saved world size, and that resharding goes through
            ``torch.distributed.checkpoint`` with ``SnapshotReader``); a saved device mesh
            that cannot be rebuilt and is not in ``mesh``.
    """
    shm = os.environ.get("ELAUNCH_CHECKPOINT_SHM")
    if not shm:
        from elaunch.checkpoint import _local

        found = _local.load(map_location, **_ranks())
        return None if found is None else Snapshot(found[0], _copy_into(found[1], into, mesh))
    path = os.environ.get("ELAUNCH_CHECKPOINT_RESTORE", "")
    if not path:
        return None
    expect = os.environ.get("ELAUNCH_CHECKPOINT_STEP", "").strip()
    expect_step = int(expect) if expect else None
    if path.endswith(".pt"):
        snap = _load_persisted(path, map_location, expect_step)
        return Snapshot(snap.step, _copy_into(snap.state, into, mesh))
    from elaunch.checkpoint import _read, _tree

    info, state = _read.read(path, map_location, expect_step, into, dtensors=_tree.DTensorMaker(mesh))
    return Snapshot(info.step, state)


def _copy_into(state: Any, into: Any, mesh: Any = None) -> Any:
    """``state`` as loaded from a ``torch.save`` file: its DTensor entries made DTensors again (or copied into
    ``into``'s), and its tensors copied into ``into``'s twins (see :func:`load`)."""
    from elaunch.checkpoint import _tree

    state = _tree.decode_dtensors(state, _tree.DTensorMaker(mesh), into)
    return state if into is None else _tree.copy_into(state, into)


def _load_persisted(path: str, map_location, expect_step: int | None) -> Snapshot:
    from elaunch.checkpoint import persisted

    try:
        payload = persisted.load_rank_file(path, map_location)
    except OSError as exc:
        raise CheckpointError(f"cannot read the persisted checkpoint {path}: {exc}") from exc
    if expect_step is not None and payload["step"] != expect_step:
        raise CheckpointError(f"{path} holds step {payload['step']}, the job agreed on step {expect_step}")
    return Snapshot(payload["step"], payload["state"])


def read_slot(path: str, map_location="cpu") -> Snapshot:
    """The newest commit of the slot file ``path`` (a slot, replica or restore file), tensors copied out.

    Args:
        path: a file in the slot format (:mod:`elaunch.checkpoint.slotfile`).
        map_location: as for :func:`load`; by default every tensor lands on the CPU.

    Raises:
        UnsafeStateError: the state needs a class weights-only loading does not allow.
        CheckpointError: the file is missing, holds no committed snapshot, or was
            written to while it was read (read it again: the writer committed or died).
    """
    from elaunch.checkpoint import _read

    info, state = _read.read(path, map_location)
    return Snapshot(info.step, state)
