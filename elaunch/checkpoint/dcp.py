"""``torch.distributed.checkpoint`` (DCP) over elaunch's in-memory snapshots: :class:`SnapshotWriter`, :class:`SnapshotReader`.

Sharded state (FSDP2, tensor parallelism: DTensors) is saved the way TorchTitan,
Lightning's FSDP strategy and Accelerate already save it, through DCP, with these as its
storage::

    import torch.distributed.checkpoint as dcp
    from elaunch.checkpoint import SnapshotReader, SnapshotWriter

    reader = SnapshotReader()
    if reader.step is not None:                 # the step the whole job resumes from, or None
        dcp.load(state, storage_reader=reader)  # resharded when the world size changed
        start = reader.step + 1
    for step in range(start, steps):
        ...
        dcp.save(state, storage_writer=SnapshotWriter(step=step))

DCP's planners stay in charge: they choose what each rank writes and, on load, which
saved chunks each rank reads (resharding). Only the storage is elaunch's:

* **Save** (under elaunch, ``ELAUNCH_CHECKPOINT_SHM`` set): each rank's part is one
  snapshot in its slot files (``elaunch.checkpoint.slotfile``, flagged
  :data:`~elaunch.checkpoint.slotfile.RESHARDABLE`), committed before ``dcp.save``
  returns. A rank keeps every item of its local plan, not only those DCP's dedup left to
  it (a replicated tensor is written by one rank only), so that at an unchanged world size
  each rank restores from its own snapshot alone, from its node's memory. A part's meta is a
  JSON document (:data:`FORMAT`): its items (where each lies in the slot's data) and the
  layout of its own chunks (each tensor's global size and properties, the chunks this rank
  saved: DCP's ``Metadata`` less its storage data, for this rank's items only), which a
  rank knows without any collective. So ``dcp.async_save`` commits the part in
  :meth:`SnapshotWriter.stage`, before it returns (``SnapshotWriter`` is DCP's
  ``AsyncStager``); DCP's planning then runs in its thread with nothing left to copy. The
  agent replicates, persists (as an ordinary DCP directory: the union of the ranks' layouts
  once it covers every tensor) and restores the snapshots as it does ``ckpt.save``'s, with
  one step for the whole job.
* **Load**: :meth:`SnapshotReader.read_metadata` opens the file the agent chose for this rank
  (``ELAUNCH_CHECKPOINT_RESTORE``) of the step the job agreed on (``ELAUNCH_CHECKPOINT_STEP``):
  at an unchanged world size this rank's own part, alone; else also every other part of
  that step in the node directory (``slots/``, ``replicas/``, and ``restore/``, where the agent
  fetched peers' snapshots before the workers started). The layout is the union of the
  parts opened; a region of a tensor none of them covers is listed as a chunk of its own (a
  gap). When DCP's plan asks for a gap, :meth:`SnapshotReader.prepare_local_plan` opens the
  node's other parts and reads the region from the chunks that cover it; a region no part
  here covers raises :class:`~elaunch.checkpoint.CheckpointError` naming it (DCP would
  otherwise leave it as it was). :meth:`SnapshotReader.read_data`
  copies each chunk DCP asks for from the mapping, and checks afterwards that no file
  was rewritten while it was read. When the agent chose a persisted DCP directory
  (no copy of some rank's part survived in memory), the reader reads it with DCP's
  ``FileSystemReader``, its ``.metadata`` unpickled weights-only.
* **Without elaunch** (torchrun, no launcher) the same calls read and write ordinary DCP
  directories with DCP's ``FileSystemWriter``/``FileSystemReader``: the ``checkpoint_id``
  given to ``dcp.save``/``dcp.load`` when it is a path, else
  ``ELAUNCH_CHECKPOINT_DIR/dcp/step_<step:012d>`` (the layout the agent's persister writes).

The step comes from the caller: ``SnapshotWriter(step=...)``, or the number at the end of
the ``checkpoint_id`` (``dcp.save(sd, checkpoint_id="ckpt/step-120", storage_writer=SnapshotWriter())``).

Nothing is unpickled except as ``torch.load(weights_only=True)`` does (a part's meta is JSON,
a non-tensor item's bytes are loaded weights-only): a snapshot may come from a peer node. Imported only by the workers (it imports torch).
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import pickle
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from elaunch.checkpoint import persisted, slotfile
from elaunch.checkpoint.dcp_layout import decode_layout, encode_layout, gaps, union_layouts
from elaunch.checkpoint.persisted import persisted_dir

__all__ = ["SnapshotWriter", "SnapshotReader", "step_of", "persisted_dir", "FORMAT"]

#: The ``format`` of a DCP part (one rank's snapshot): its slot's meta is the JSON document ``{"format": FORMAT,
#: "rank": r, "world_size": w, "layout": (this part's own chunks, as encode_layout), "items": [[fqn, offsets or None
#: (bytes), data offset, dtype, shape, planned], ...]}``, the tensors raw in the slot's data: read with no unpickling.
#: ``planned``: DCP's global plan gave the item to this rank (False: to another rank, the persister skips it; None:
#: not known, a part ``dcp.async_save`` staged before planning). Version 1 pickled the job's whole layout in every part.
FORMAT = "elaunch.dcp/2"
_ID_STEP = re.compile(r"(\d+)$")


def step_of(checkpoint_id: str | os.PathLike | int | None) -> int | None:
    """The step a checkpoint id names: an int, or the number its last path component ends with; else None.

    ``"ckpt/step-120"`` -> 120, ``"step_000000000120"`` -> 120, ``120`` -> 120, ``"latest"`` -> None.
    """
    if checkpoint_id is None or isinstance(checkpoint_id, bool):
        return None
    if isinstance(checkpoint_id, int):
        return checkpoint_id if checkpoint_id >= 0 else None
    m = _ID_STEP.search(os.path.basename(os.fspath(checkpoint_id).rstrip("/")))
    return int(m.group(1)) if m else None


def _is_path(checkpoint_id) -> bool:
    return checkpoint_id is not None and not isinstance(checkpoint_id, int) and (
        os.sep in os.fspath(checkpoint_id) or os.path.isdir(os.fspath(checkpoint_id)))


def _shm() -> str:
    return os.environ.get("ELAUNCH_CHECKPOINT_SHM", "")


def _local_dir() -> str:
    from elaunch.checkpoint import _local

    return _local.directory()


#: planner class -> (items, planner data) of the last usable local plan this process saved with it
_LAST_LOCAL_PLAN: dict[str, tuple[list, Any]] = {}


# -- the writer ------------------------------------------------------------------------------------------------

class SnapshotWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that commits this rank's part of the checkpoint to elaunch's memory.

    ``dcp.save(state, storage_writer=SnapshotWriter(step=step))`` returns once this rank's
    part is committed in its slot (the previous step's stays whole until then), as
    ``ckpt.save`` does; the agent replicates and persists it. It is also DCP's
    ``AsyncStager``: ``dcp.async_save(state, storage_writer=SnapshotWriter(step=step))``
    commits this rank's part in :meth:`stage`, before it returns, with no collective (DCP's
    planning then runs in its thread and finds nothing left to copy). Without elaunch it
    writes an ordinary DCP directory (see the module's text). It mirrors DCP's
    ``FileSystemWriter`` (same calls, same ``dcp.save`` semantics), not a torchrun feature.

    Args:
        step: the training step (an int >= 0). None: the number at the end of the
            ``checkpoint_id`` passed to ``dcp.save`` (``dcp.async_save`` then stages a CPU
            copy, as DCP's default stager, and commits in its thread: the id is not known
            when it stages).

    Raises (from ``dcp.save``, wrapped by DCP in a ``CheckpointException`` on the rank that raised):
        ValueError: no step (none given, and the checkpoint id ends with no number), or a negative one.
        SnapshotTooLarge: this rank's part does not fit the free shared memory; nothing was overwritten.
        TypeError: an item cannot be saved (a tensor on the meta device, sparse, quantized).
        CheckpointError: (``dcp.async_save``) the planner given plans items the staged part lacks.
    """

    _synchronize_after_execute = False  # stage() returns once the part is committed: nothing left to wait for

    def __init__(self, step: int | None = None) -> None:
        super().__init__()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or not 0 <= step <= slotfile.MAX_STEP):
            raise ValueError(f"step must be an int from 0 to 2**63 - 1, not {step!r}")
        self._given = step
        self.step: int | None = step
        self._rank = int(os.environ.get("RANK", "0") or 0)
        self._world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._local_plan: tuple[list, Any] | None = None
        self._staged: dict | None = None  # {"step": int, "sizes": {MetadataIndex: bytes}} of stage()'s commit
        self._fs: FileSystemWriter | None = None
        self._checkpoint_id = None
        self.path: str | None = None  #: the slot file (or DCP directory) the last save wrote

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Take the ``checkpoint_id`` of the next save (``dcp.save`` calls it only when it was given one)."""
        self._checkpoint_id = checkpoint_id

    @property
    def checkpoint_id(self):
        return self._checkpoint_id

    def stage(self, state_dict: dict) -> dict:
        """Commit this rank's part of ``state_dict`` to its slot now (``dcp.async_save`` calls it before it returns).

        The items are those of DCP's default local save plan (``DefaultSavePlanner``: a
        DTensor's local shard at its global offsets, a plain tensor whole, anything else as
        ``torch.save`` bytes), computed on this rank alone: no collective. The part holds
        this rank's own chunks' layout; readers join the parts they have (see
        :class:`SnapshotReader`). DCP's planning then runs in its thread and
        :meth:`write_data` only checks that what it planned for this rank was committed.

        Returns:
            ``state_dict`` itself (its data is already in the slot: the thread copies
            nothing). Without elaunch, or without ``step=``: a CPU copy, as DCP's default
            stager makes, written in DCP's thread.

        Raises:
            As :meth:`write_data` (``SnapshotTooLarge``, ``TypeError``).
        """
        self._staged = None
        if not _shm() or self._given is None:
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                return stager.stage(state_dict)
            finally:
                stager.close()
        planner = _StagePlanner()
        planner.set_up_planner(state_dict, None, False)
        plan, layout = planner.local_plan()
        self.path, sizes = _commit(plan.items, plan.planner_data, planner, self._given, rank=self._rank,
                                   world_size=self._world, layout=layout)
        self._staged = {"step": self._given, "sizes": sizes}
        return state_dict

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Start a save: take the step, choose memory or a DCP directory (called by ``dcp.save`` on every rank).

        Raises:
            ValueError: no step is known (see the class).
        """
        if kwargs.get("rank") is not None:
            self._rank = int(kwargs["rank"])
        self.step = self._given if self._given is not None else step_of(self._checkpoint_id)
        if self.step is None:
            raise ValueError(f"SnapshotWriter needs the step: SnapshotWriter(step=...) or a checkpoint_id ending in it "
                             f"(like 'step-120'), not {self._checkpoint_id!r}")
        if self.step > slotfile.MAX_STEP:
            raise ValueError(f"checkpoint_id={self._checkpoint_id!r}: its step must be at most 2**63 - 1")
        self._local_plan = None
        self._fs = None
        if not _shm():
            cid = self._checkpoint_id
            path = os.fspath(cid) if _is_path(cid) else persisted_dir(_local_dir(), self.step)
            self._fs = FileSystemWriter(path)
            self._fs.set_up_storage_writer(is_coordinator, *args, **kwargs)
            self.path = path

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._fs is not None:
            return self._fs.prepare_local_plan(plan)
        # all of them: DCP's dedup may leave a replicated tensor to one rank. A cached plan (DefaultSavePlanner's
        # enable_plan_caching: no change since the last save) comes empty and unusable: write_data takes the items
        # of the last usable one
        self._local_plan = (list(plan.items), plan.planner_data) if plan.usable else None
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self._fs.prepare_global_plan(plans) if self._fs is not None else plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Commit this rank's part (every item of its local plan; those DCP's plan gave it marked), or, after
        :meth:`stage` committed it, check that each item DCP planned for this rank is in it.

        Raises:
            As the class says.
        """
        if self._fs is not None:
            return self._fs.write_data(plan, planner)
        staged, self._staged = self._staged, None
        if staged is not None and staged["step"] == self.step:
            sizes = staged["sizes"]
            missing = [f"{wi.index.fqn} at {list(wi.index.offset) if wi.index.offset is not None else 'bytes'}"
                       for wi in plan.items if wi.index not in sizes]
            if missing:
                from elaunch.checkpoint import CheckpointError

                raise CheckpointError(
                    f"step {self.step}: DCP's plan gives this rank {len(missing)} item(s) that dcp.async_save's "
                    f"staging (DCP's default local save plan) did not commit ({', '.join(missing[:5])}): a planner "
                    f"that plans other items than DefaultSavePlanner's goes with dcp.save, not dcp.async_save")
        else:
            key = f"{type(planner).__module__}.{type(planner).__qualname__}"  # DCP caches plans per planner class
            if self._local_plan is not None:
                _LAST_LOCAL_PLAN[key] = self._local_plan
            items, planner_data = _LAST_LOCAL_PLAN.get(key, (list(plan.items), plan.planner_data))
            in_plan = {wi.index for wi in plan.items}
            self.path, sizes = _commit(items, planner_data, planner, self.step, rank=self._rank,
                                       world_size=self._world, in_plan=in_plan)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=wi.index, size_in_bytes=sizes.get(wi.index, 0), storage_data=None)
                        for wi in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing in memory (each rank committed its part in ``write_data``). Without elaunch: the DCP
        directory's ``.metadata`` (coordinator), then, in the default directory, the removal of the steps
        older than the complete one before this (two complete steps stay)."""
        if self._fs is None:
            return
        self._fs.finish(metadata, results)
        if not _is_path(self._checkpoint_id):  # the default directory: keep this step and the complete one before
            before = persisted.newest_dcp(_local_dir(), self.step - 1)
            if before is not None:
                persisted.prune_dcp(_local_dir(), before[0])

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: DCP never picks this writer by itself; pass it as ``storage_writer``."""
        return False

    def storage_meta(self):
        return self._fs.storage_meta() if self._fs is not None else None



class _StagePlanner(DefaultSavePlanner):
    """DCP's default save planner as :meth:`SnapshotWriter.stage` uses it: the same items, planned once while the
    state keeps its structure, and a DTensor's data taken as its local tensor.

    Planning a DTensor's chunk (DTensor's ``compute_local_shape_and_global_offset``) and
    ``to_local`` (an autograd function) cost tens of microseconds each: 10-40 ms for an FSDP2
    state of 300 DTensors, as much as the copy. So the last local plan (and its layout) is
    kept with the state's signature (each leaf's fqn, global and local shape, dtype,
    ``requires_grad``, mesh and placements: everything DCP's plan of it depends on) and taken
    again while the signature is the same. A state holding another tensor subclass is
    planned every time.
    """

    #: (signature, plan, layout, the meshes the signature names by id, kept alive so that no id is reused)
    _last: tuple | None = None

    def local_plan(self) -> tuple[SavePlan, dict]:
        """DCP's default local save plan of the state and the layout of its items."""
        sig, meshes = _signature(self.state_dict)
        last = _StagePlanner._last
        if sig is not None and last is not None and last[0] == sig:
            self.plan = last[1]
            return last[1], last[2]
        plan = self.create_local_plan()
        layout = encode_layout([plan.items], plan.planner_data or {})
        _StagePlanner._last = (sig, plan, layout, meshes) if sig is not None else None
        return plan, layout

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if type(obj) is DTensor:
            return obj._local_tensor  # what __get_tensor_shard__ returns (to_local()), without autograd
        return super().lookup_object(index)


def _signature(flat: dict) -> tuple[tuple | None, list]:
    """What DCP's local save plan of the flattened state ``flat`` depends on, and the meshes it names; None: a
    leaf is a tensor of another subclass (its plan is its own)."""
    sig, meshes = [], []
    for fqn, v in flat.items():
        kind = type(v)
        if kind is DTensor:
            mesh = v.device_mesh
            meshes.append(mesh)
            sig.append((fqn, v.shape, v.dtype, v.requires_grad, v._local_tensor.shape, id(mesh), tuple(v.placements)))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            sig.append((fqn, v.shape, v.dtype, v.requires_grad))
        elif isinstance(v, torch.Tensor):
            return None, []
        else:
            sig.append((fqn,))
    return tuple(sig), meshes


def _commit(items: list, planner_data: Any, planner: SavePlanner, step: int, *, rank: int, world_size: int,
            in_plan: set | None = None, layout: dict | None = None) -> tuple[str, dict]:
    """Commit ``items`` (write items, their data from ``planner``) as this rank's DCP part, in this local rank's slot
    that does not hold its newest commit, flagged reshardable.

    Args:
        in_plan: the indices DCP's global plan gave this rank (the persister writes those only);
            None: not known (a part :meth:`SnapshotWriter.stage` committed before any plan).
        layout: the items' layout, when known already (else made from them).

    Returns:
        ``(slot path, {item index: bytes})``.

    Raises:
        TypeError: an item's tensor cannot be saved (named). SnapshotTooLarge: it does not fit the free
            shared memory; nothing is written. CheckpointError: the agent's directory is gone.
    """
    saved, sizes = [], {}
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            offsets = None
        else:
            t = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(data)
            offsets = list(item.index.offset)
            if t.device.type == "meta" or t.layout != torch.strided or t.is_quantized:
                raise TypeError(f"SnapshotWriter: cannot save {item.index.fqn!r}: a {t.layout} tensor on "
                                f"{t.device}{' (quantized)' if t.is_quantized else ''} has no plain data to copy")
        saved.append((item.index.fqn, offsets, t, None if in_plan is None else item.index in in_plan))
        sizes[item.index] = t.numel() * t.element_size()
    if layout is None:
        layout = encode_layout([items], planner_data or {})
    return _write_part(saved, layout, step, rank=rank, world_size=world_size), sizes


def _write_part(saved: list[tuple], layout: dict, step: int, *, rank: int, world_size: int) -> str:
    """Copy ``saved`` (``(fqn, offsets or None, tensor, planned)``) into the slot as ``_shm.save`` does, its meta
    the part's JSON document (:data:`FORMAT`) instead of a pickle; return the slot's path."""
    from elaunch.checkpoint import _shm as shm_mod
    from elaunch.checkpoint import _tree

    refs, entries, at = [], [], 0
    for fqn, offsets, t, planned in saved:
        dtype, nbytes = str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()
        refs.append((t, _tree.TensorRef(at, nbytes, dtype, tuple(t.shape), str(t.device))))
        entries.append([fqn, offsets, at, dtype, list(t.shape), planned])
        at += -(-nbytes // _tree.TENSOR_ALIGN) * _tree.TENSOR_ALIGN
    meta = json.dumps({"format": FORMAT, "rank": rank, "world_size": world_size, "layout": layout,
                       "items": entries}, separators=(",", ":")).encode()
    shm, need = _shm(), slotfile.file_size(len(meta), at)
    shm_mod._make_slots_dir(shm)
    with shm_mod._LOCK:
        path = slotfile.slot_to_write(shm, int(os.environ.get("LOCAL_RANK", "0") or 0))
        shm_mod.check_space(shm, path, need)
        slot = shm_mod._slot(path)
        if slot.size < need:
            shm_mod._grow(slot, shm, need)
        seq = slotfile.begin(slot.mm, slot.fd)
        slot.mm[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
        shm_mod.copy_in(slot, slotfile.data_offset(len(meta)), refs)
        slotfile.commit(slot.mm, seq, step=step, rank=rank, world_size=world_size, replicated=False,
                        meta_len=len(meta), data_len=at, fd=slot.fd, reshardable=True)
    return path


# -- the reader ------------------------------------------------------------------------------------------------

@dataclass
class _Part:
    """One snapshot file of the step: its header, its items ``(fqn, offsets or None) -> TensorRef`` (offsets into
    its data), their ``planned`` flags, and the layout of its own chunks."""

    info: slotfile.SlotInfo
    refs: dict[tuple, Any]
    layout: dict
    planned: dict[tuple, bool | None]


def _parse_part(meta: bytes, info: slotfile.SlotInfo, path: str) -> _Part | None:
    """The part whose JSON document ``meta`` is (no unpickling); None when it is not one of :data:`FORMAT`.

    Raises:
        CheckpointError: it claims the format but an item is malformed or points past the data.
    """
    from elaunch.checkpoint import CheckpointError
    from elaunch.checkpoint._tree import _DTYPES, TensorRef

    try:
        doc = json.loads(meta)
    except (ValueError, UnicodeDecodeError):
        return None  # another format (elaunch.dcp/1 was a pickle)
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT):
        return None
    refs, planned = {}, {}
    try:
        layout = doc["layout"]
        if not (isinstance(layout, dict) and isinstance(layout.get("fqns"), dict)):
            raise TypeError("no layout")
        for fqn, offsets, at, dtype, shape, flag in doc["items"]:
            ints = [at, *shape, *(offsets or ())]
            if not (isinstance(fqn, str) and (offsets is None or isinstance(offsets, list)) and dtype in _DTYPES
                    and isinstance(shape, list) and all(type(v) is int and v >= 0 for v in ints)
                    and flag in (None, True, False)):
                raise ValueError(f"item {fqn!r:.100}")
            nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
            if at + nbytes > info.data_len:
                raise ValueError(f"item {fqn!r:.100} ends past the data")
            key = (fqn, None if offsets is None else tuple(offsets))
            refs[key] = TensorRef(at, nbytes, dtype, tuple(shape), "cpu")
            planned[key] = flag
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the DCP snapshot {path} (step {info.step}) is malformed ({type(exc).__name__}: "
                              f"{exc})") from exc
    return _Part(info, refs, layout, planned)


def _open_part(path: str, step: int) -> _Part | None:
    """The DCP snapshot of ``step`` in ``path`` (header and meta only), or None (another step, not DCP, torn,
    or rewritten while its meta was read: the meta is copied under the slot's sequence lock).

    Raises:
        CheckpointError: as :func:`_parse_part`.
    """
    got = slotfile.read_meta(path, with_meta=lambda info: info.step == step and info.reshardable)
    if got is None or got[1] is None:
        return None
    info, meta = got
    return _parse_part(meta, info, path)


def read_part(info: slotfile.SlotInfo) -> tuple[dict, list] | None:
    """The DCP part committed in ``info``'s slot, its data copied out (the persister's read; no unpickling).

    Returns:
        ``(layout, [[fqn, offsets or None, tensor, planned], ...])``: the layout of the part's own
        chunks; each tensor a CPU view of one copy of the data (a bytes item: uint8); ``planned``
        True/False when DCP's plan was known at the commit (False: another rank writes it), else
        None. None when the slot no longer holds that commit, or is no part of :data:`FORMAT`.

    Raises:
        CheckpointError: as :func:`_parse_part`. OSError: the file cannot be read.
    """
    try:
        fd = os.open(info.path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            if slotfile.parse(mm, info.path, fd) != info:
                return None
            meta = bytes(mm[slotfile.META_AT:slotfile.META_AT + info.meta_len])
            with memoryview(mm) as view:
                data = bytearray(view[info.data_at:info.data_at + info.data_len])
            if not slotfile.still(mm, info, fd):
                return None
    finally:
        os.close(fd)
    part = _parse_part(meta, info, info.path)
    if part is None:
        return None
    base = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    items = [[fqn, None if offsets is None else list(offsets),
              base[ref.offset:ref.offset + ref.nbytes].view(ref.torch_dtype).view(ref.shape), part.planned[key]]
             for key, ref in part.refs.items() for fqn, offsets in (key,)]
    return part.layout, items



class SnapshotReader(StorageReader):
    """A DCP ``StorageReader`` over the snapshots of the step the job agreed on (see the module's text).

    ``dcp.load(state, storage_reader=SnapshotReader())`` fills ``state`` in place, resharded
    by DCP's planner when the world size or the sharding changed. It mirrors DCP's
    ``FileSystemReader``.

    Attributes:
        step: the step this reader loads (an int), or None when there is nothing to load
            (a fresh start): check it before calling ``dcp.load``.
        source: ``"memory"`` (snapshots in this node's memory), ``"disk"`` (a persisted or
            local DCP directory) or None.

    Raises (from ``dcp.load``, wrapped by DCP in a ``CheckpointException``):
        CheckpointError: nothing to load (``step`` is None), a region of the state this rank loads
            is in none of this node's snapshots (named), the parts disagree or one is malformed,
            or a snapshot was rewritten while it was read.
        UnsafeStateError: a non-tensor item's bytes need a class weights-only loading does not allow.
    """

    def __init__(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().__init__()
        self._index: dict[tuple, tuple[_Part, Any]] = {}  # (fqn, offsets or None) -> the part holding it, its ref
        self._parts: list[_Part] = []
        self._unopened: list[str] = []  # this node's files of the step not opened yet
        self._real: dict[str, list[tuple]] = {}  # fqn -> (offsets, sizes) of each saved chunk known
        self._gaps: set[tuple] = set()  # (fqn, offsets) of each chunk read_metadata listed for an uncovered region
        self._world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._fs: FileSystemReader | None = None
        self._rank = int(os.environ.get("RANK", "0") or 0)
        self.step, self.source = None, None
        self._restore = ""
        self._choose(checkpoint_id)

    def _choose(self, checkpoint_id) -> None:
        """Find what to load: the agent's choice under elaunch, else the id's or the newest local DCP directory."""
        shm = _shm()
        self._fs = None
        if shm:
            expect = os.environ.get("ELAUNCH_CHECKPOINT_STEP", "").strip()
            self._restore = os.environ.get("ELAUNCH_CHECKPOINT_RESTORE", "")
            self.step = int(expect) if expect and self._restore else None
            if self.step is not None and os.path.isdir(self._restore):
                self._fs, self.source = _SafeFileSystemReader(self._restore), "disk"
            elif self.step is not None:
                self.source = "memory"
            return
        path = os.fspath(checkpoint_id) if _is_path(checkpoint_id) else _newest_dir(_local_dir())
        if path and os.path.exists(os.path.join(path, ".metadata")):
            self._fs, self.source, self.step = _SafeFileSystemReader(path), "disk", step_of(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self._choose(checkpoint_id)
        if self._fs is not None:
            self._fs.reset()

    @property
    def checkpoint_id(self):
        return None

    def read_metadata(self, *args: Any) -> Metadata:
        """The layout of the step to load: the union of the parts opened, with each chunk's holder among them.

        The agent's file for this rank is opened first. When it is this rank's own part at an
        unchanged world size it is the only one opened (it holds every chunk this rank loads,
        unless the sharding changed: then :meth:`prepare_local_plan` opens the others); else every
        part of the step on this node (``slots/``, ``replicas/``, ``restore/``) of its world size.
        A region of a tensor no opened part covers is listed as a chunk of its own (a gap), so
        that DCP's plan asks for it when this rank needs it; :meth:`prepare_local_plan` then
        finds it in the other parts or raises.

        (No ``**kwargs``: DCP then never asks for rank-local metadata, which snapshots do not have.)

        Raises:
            CheckpointError: as the class says.
        """
        from elaunch.checkpoint import CheckpointError

        if self._fs is not None:
            return self._fs.read_metadata()
        if self.step is None:
            raise CheckpointError("there is no snapshot to load (SnapshotReader().step is None: a fresh start)")
        files = [self._restore] + [p for p in slotfile.files(_shm(), ("slots", "replicas", "restore"))
                                   if p != self._restore]
        first = None
        while files and first is None:
            first = _open_part(files.pop(0), self.step)
        if first is None:
            raise CheckpointError(f"no DCP snapshot of step {self.step} is on this node ({_shm()}); the agent chose "
                                  f"{self._restore}")
        self._parts, self._unopened, self._index = [first], files, {}
        self._add(first)
        if (first.info.rank, first.info.world_size) != (self._rank, self._world):  # resharding: take them all
            self._open_rest()
        layout = union_layouts([p.layout for p in self._parts])
        metadata = decode_layout(layout)
        self._real, self._gaps = {}, set()
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self._real[fqn] = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
                for offsets, sizes in gaps(list(md.size), self._real[fqn]):
                    md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                    self._gaps.add((fqn, tuple(offsets)))
        # no storage_data: DCP's load reads it only through the storage reader, and this one finds a chunk by its
        # (fqn, offsets) in self._index (one MetadataIndex per chunk cost ~0.1 ms each, 40 ms for 300 tensors)
        return metadata

    def _open_rest(self) -> None:
        """Open this node's other parts of the step (of the first part's world size); add their chunks."""
        world = self._parts[0].info.world_size
        for f in self._unopened:
            part = _open_part(f, self.step)
            if part is not None and part.info.world_size == world:
                self._parts.append(part)
                self._add(part)
        self._unopened = []
        layout = union_layouts([p.layout for p in self._parts])
        self._real = {fqn: [(tuple(o), tuple(s)) for o, s in e[3]]
                      for fqn, e in layout["fqns"].items() if e[0] == "tensor"}

    def _add(self, part: _Part) -> None:
        """Make ``part``'s chunks readable (a chunk already held by a part added before stays with that one)."""
        for key, ref in part.refs.items():
            self._index.setdefault(key, (part, ref))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan, each request of a gap replaced by requests of the chunks that cover it.

        A request of a gap (a region no part opened so far covers) first opens this node's
        other parts of the step, then is split over the saved chunks it overlaps.

        Raises:
            CheckpointError: some region this rank loads is in none of this node's snapshots (named):
                nothing is loaded.
        """
        if self._fs is not None:
            return self._fs.prepare_local_plan(plan)
        from elaunch.checkpoint import CheckpointError

        def held(req) -> bool:
            key = _req_key(req)
            return key in self._index and key not in self._gaps

        if self._unopened and not all(held(req) for req in plan.items):
            self._open_rest()
        items, missing, split = [], [], False
        for req in plan.items:
            if held(req):
                items.append(req)
                continue
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                missing.append(f"{fqn} at bytes")
                continue
            pieces, holes = self._pieces(req)
            if holes:
                missing += [f"{fqn} at {at}" for at in holes]
                continue
            items += pieces
            split = True
        if missing:
            missing = list(dict.fromkeys(missing))
            raise CheckpointError(
                f"step {self.step}: {len(missing)} chunk(s) this rank loads are in none of this node's snapshots "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): the agent did not gather every "
                f"rank's part; nothing was loaded")
        return replace(plan, items=items) if split else plan

    def _pieces(self, req: ReadItem) -> tuple[list[ReadItem], list[list[int]]]:
        """``req``'s region (global coordinates) as requests of the held chunks it overlaps, and the global offsets
        of the boxes of it that none covers (empty: all held)."""
        fqn, base = _req_key(req)
        lo = [b + s for b, s in zip(base, req.storage_offsets)]
        hi = [a + n for a, n in zip(lo, req.lengths)]
        out, boxes = [], []
        for offsets, sizes in self._real.get(fqn, ()):
            a = [max(x, o) for x, o in zip(lo, offsets)]
            b = [min(y, o + s) for y, o, s in zip(hi, offsets, sizes)]
            if any(x >= y for x, y in zip(a, b)) or (fqn, offsets) not in self._index:
                continue
            lengths = [y - x for x, y in zip(a, b)]
            out.append(ReadItem(type=req.type, dest_index=req.dest_index,
                                dest_offsets=torch.Size(d + x - l for d, x, l in zip(req.dest_offsets, a, lo)),
                                storage_index=MetadataIndex(fqn, offsets),
                                storage_offsets=torch.Size(x - o for x, o in zip(a, offsets)),
                                lengths=torch.Size(lengths)))
            boxes.append([[x - l for x, l in zip(a, lo)], lengths])
        holes = gaps(list(req.lengths), boxes)
        return out, [[l + h for l, h in zip(lo, box[0])] for box in holes]

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._fs.prepare_global_plan(plans) if self._fs is not None else plans

    @torch.no_grad()
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each chunk DCP asks for from its snapshot's mapping, then check no snapshot changed meanwhile."""
        planner = _WeightsOnlyBytes(planner)
        if self._fs is not None:
            return self._fs.read_data(plan, planner)
        from elaunch.checkpoint import CheckpointError

        by_part: dict[str, list] = {}
        for req in plan.items:
            part, ref = self._index[_req_key(req)]
            by_part.setdefault(part.info.path, []).append((req, part, ref))
        for path, reqs in by_part.items():
            info = reqs[0][1].info
            fd = os.open(path, os.O_RDONLY)
            try:
                with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
                    if slotfile.parse(mm, path, fd) != info:
                        raise CheckpointError(f"{path} changed before it was read (step {self.step})")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)  # "the buffer is not writable": read only
                        base = torch.frombuffer(mm, dtype=torch.uint8)
                    try:
                        self._copy(base, info, reqs, planner, fd)
                    finally:
                        del base
                    if not slotfile.still(mm, info, fd):
                        raise CheckpointError(f"{path} was written to while it was read (step {self.step})")
            finally:
                os.close(fd)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _copy(base: torch.Tensor, info: slotfile.SlotInfo, reqs: list, planner: LoadPlanner, fd: int) -> None:
        """Each request's chunk into its target: a whole saved tensor bound for a contiguous CPU target is read
        with ``preadv`` straight into it (no page fault per 4 KiB of a fresh mapping: about 2x faster), any other
        through the mapping (``base``)."""
        from elaunch.checkpoint import _read

        for req, _part, ref in reqs:
            raw = base[info.data_at + ref.offset:info.data_at + ref.offset + ref.nbytes]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                continue
            src = raw.view(ref.torch_dtype).view(ref.shape)
            for dim, (at, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, at, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                from elaunch.checkpoint import CheckpointError

                raise CheckpointError(f"chunk {req.storage_index.fqn} at {list(req.storage_offsets)}: the snapshot "
                                      f"holds {list(src.size())}, the state wants {list(target.size())}")
            whole = tuple(src.shape) == tuple(ref.shape) and not any(req.storage_offsets)
            if (whole and target.device.type == "cpu" and target.dtype == ref.torch_dtype and target.is_contiguous()
                    and not (target.is_conj() or target.is_neg()) and ref.nbytes):
                _read._pread(fd, target.data_ptr(), ref.nbytes, info.data_at + ref.offset)
            else:
                target.copy_(src)
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: DCP never picks this reader by itself; pass it as ``storage_reader``."""
        return False


def _req_key(req: ReadItem) -> tuple:
    """The ``(fqn, offsets or None)`` of the saved chunk a read item asks for (a part's item key)."""
    return (req.storage_index.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(req.storage_index.offset))


class _WeightsOnlyBytes:
    """A load planner whose ``load_bytes`` gets only bytes that ``torch.load(weights_only=True)`` loads.

    DCP's ``DefaultLoadPlanner.load_bytes`` unpickles a non-tensor item (an int, a string, a
    dict of them) with ``torch.load(weights_only=False)``; its bytes may come from a peer's
    replica, or a persisted directory other nodes write. Each is first loaded weights-only
    (torch's allow-list, with the classes of ``torch.serialization.add_safe_globals``); a
    refusal raises :class:`~elaunch.checkpoint.UnsafeStateError` and the planner never sees
    the bytes. Every other attribute is the planner's.
    """

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def __getattr__(self, name: str):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from elaunch.checkpoint import UnsafeStateError

        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeStateError(f"the checkpoint item {read_item.dest_index.fqn!r} does not load weights-only "
                                   f"(as torch.load(weights_only=True)); allow its classes with "
                                   f"torch.serialization.add_safe_globals([...]) before dcp.load ({exc})") from exc
        self._planner.load_bytes(read_item, io.BytesIO(data))


def _newest_dir(directory: str) -> str:
    """The newest complete DCP directory (``.metadata`` present) under ``directory/dcp``, or ""."""
    found = persisted.newest_dcp(directory)
    return found[1] if found else ""


# -- reading a DCP directory's .metadata without running code ------------------------------------------------------

#: (module, name) of every global a DCP ``.metadata`` names (torch 2.x): DCP's metadata classes, torch's Size,
#: layouts (by name) and dtypes (:func:`_find`), and the path class of ``StorageMeta.checkpoint_id``.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_METADATA_GLOBALS` and torch's dtypes: nothing else can be called.

    torch's own weights-only unpickler would be the first choice, but it reads protocol 2
    only, and DCP writes ``.metadata`` with ``pickle.dump``'s default (protocol 4, FRAME
    opcodes). The rule is the same: an allow-list of classes whose construction runs no
    code of the file's choosing.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class a DCP .metadata may name")


def load_metadata(path: str) -> Metadata:
    """A DCP directory's ``.metadata``, unpickled with only DCP's metadata classes (and torch's Size, dtypes,
    layouts) allowed: what DCP's ``FileSystemReader`` reads with a plain ``pickle.load``.

    Args:
        path: the DCP directory.

    Raises:
        UnsafeStateError: it names another global (a forged file: nothing of it ran), or is not a pickle of
            DCP's ``Metadata``.
        OSError: it cannot be read.
    """
    from elaunch.checkpoint import UnsafeStateError

    with open(os.path.join(path, ".metadata"), "rb") as f:
        raw = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise UnsafeStateError(f"cannot load {path}/.metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeStateError(f"{path}/.metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, whose ``.metadata`` is unpickled weights-only (its own uses ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:
            raise FileNotFoundError("no rank-local metadata")
        metadata = load_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
