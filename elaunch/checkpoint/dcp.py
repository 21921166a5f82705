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
  each rank restores from its own snapshot alone, from its node's memory. Each rank's
  snapshot also holds the job's whole layout (every tensor's global size, properties and
  chunks, DCP's ``Metadata`` less its storage data), computed once by the coordinator in
  :meth:`SnapshotWriter.prepare_global_plan` and handed to every rank in its plan. The
  agent then replicates, persists (as an ordinary DCP directory) and restores the snapshots
  as it does ``ckpt.save``'s, with one step for the whole job.
* **Load**: :meth:`SnapshotReader.read_metadata` finds this node's snapshots of the step the
  job agreed on (``ELAUNCH_CHECKPOINT_STEP``): the file the agent chose for this rank
  (``ELAUNCH_CHECKPOINT_RESTORE``) and every snapshot of that step in the node directory
  (``slots/``, ``replicas/``, and ``restore/``, where the agent fetched peers' snapshots
  before the workers started). Every chunk this rank's load plan asks for must be in one
  of them (else :class:`~elaunch.checkpoint.CheckpointError`, naming the first missing
  chunks; DCP would otherwise leave those parts of the state as they were); the others
  need not be (at an unchanged world size each rank is given its own part alone). :meth:`SnapshotReader.read_data`
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

Nothing is unpickled except as ``torch.load(weights_only=True)`` does: a snapshot may come
from a peer node. Imported only by the workers (it imports torch).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import warnings
from torch.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from elaunch.checkpoint import slotfile

__all__ = ["SnapshotWriter", "SnapshotReader", "step_of", "persisted_dir", "FORMAT"]

#: The marker of a DCP snapshot's state (a rank's part): ``{"format": FORMAT, "rank": r, "world_size": w,
#: "layout": ..., "items": [[fqn, offsets or None (bytes), tensor, planned], ...]}``; ``planned``: DCP's plan gave
#: the item to this rank (False for a replicated tensor DCP's dedup left to another rank; the persister skips it).
FORMAT = "elaunch.dcp/1"
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


def persisted_dir(directory: str, step: int) -> str:
    """The DCP directory of ``step`` under a checkpoint directory: ``directory/dcp/step_<step:012d>``."""
    return os.path.join(directory, "dcp", f"step_{step:012d}")


def _is_path(checkpoint_id) -> bool:
    return checkpoint_id is not None and not isinstance(checkpoint_id, int) and (
        os.sep in os.fspath(checkpoint_id) or os.path.isdir(os.fspath(checkpoint_id)))


def _shm() -> str:
    return os.environ.get("ELAUNCH_CHECKPOINT_SHM", "")


def _local_dir() -> str:
    from elaunch.checkpoint import _local

    return _local.directory()


# -- the layout: DCP's Metadata as primitives (the weights-only unpickler takes no DCP class) -------------------

_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


def _properties(p: TensorProperties) -> list:
    fmt = next((name for name, f in _MEMORY_FORMATS.items() if f == p.memory_format), "contiguous_format")
    return [str(p.dtype).removeprefix("torch."), bool(p.requires_grad), fmt, bool(p.pin_memory)]


def encode_layout(items_by_rank: list[list], planner_data: dict) -> dict:
    """The job's layout from every rank's write items (``WriteItem``), as primitives.

    Returns:
        ``{"fqns": {fqn: ["bytes"] or ["tensor", properties, size, [[offsets, sizes], ...]]},
        "planner_data": {fqn: [key, ...]}}``; a chunk written by several ranks is listed once.
    """
    fqns: dict[str, list] = {}
    for items in items_by_rank:
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                fqns[fqn] = ["bytes"]
                continue
            td = item.tensor_data
            entry = fqns.setdefault(fqn, ["tensor", _properties(td.properties), list(td.size), []])
            chunk = [list(td.chunk.offsets), list(td.chunk.sizes)]
            if chunk not in entry[3]:
                entry[3].append(chunk)
    data = {str(k): [v if isinstance(v, (str, int)) else str(v) for v in path]
            for k, path in (planner_data or {}).items() if isinstance(path, (tuple, list))}
    return {"fqns": fqns, "planner_data": data}


def decode_layout(layout: Any) -> Metadata:
    """DCP's ``Metadata`` (``storage_data`` empty) of a layout :func:`encode_layout` made.

    Raises:
        CheckpointError: the layout is malformed.
    """
    from elaunch.checkpoint import CheckpointError
    from elaunch.checkpoint._tree import _DTYPES

    try:
        md: dict[str, Any] = {}
        for fqn, entry in layout["fqns"].items():
            if entry[0] == "bytes":
                md[fqn] = BytesStorageMetadata()
                continue
            _, (dtype, grad, fmt, pin), size, chunks = entry
            props = TensorProperties(dtype=_DTYPES[dtype], layout=torch.strided, requires_grad=bool(grad),
                                     memory_format=_MEMORY_FORMATS[fmt], pin_memory=bool(pin))
            md[str(fqn)] = TensorStorageMetadata(props, torch.Size(size), [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        planner_data = {str(k): tuple(v) for k, v in layout.get("planner_data", {}).items()}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"a DCP snapshot's layout is malformed ({type(exc).__name__}: {exc})") from exc
    return Metadata(state_dict_metadata=md, planner_data=planner_data)


#: planner class -> the items of the last usable local plan this process saved with it (see prepare_local_plan)
_LAST_LOCAL_ITEMS: dict[str, list] = {}


# -- the writer ------------------------------------------------------------------------------------------------

class SnapshotWriter(StorageWriter):
    """A DCP ``StorageWriter`` that commits this rank's part of the checkpoint to elaunch's memory.

    ``dcp.save(state, storage_writer=SnapshotWriter(step=step))`` returns once this rank's
    part is committed in its slot (the previous step's stays whole until then), as
    ``ckpt.save`` does; the agent replicates and persists it. ``dcp.async_save`` takes it
    too (DCP stages the state, then the write goes to memory in DCP's thread). Without
    elaunch it writes an ordinary DCP directory (see the module's text). It mirrors DCP's
    ``FileSystemWriter`` (same calls, same ``dcp.save`` semantics), not a torchrun feature.

    Args:
        step: the training step (an int >= 0). None: the number at the end of the
            ``checkpoint_id`` passed to ``dcp.save``.

    Raises (from ``dcp.save``, wrapped by DCP in a ``CheckpointException`` on the rank that raised):
        ValueError: no step (none given, and the checkpoint id ends with no number), or a negative one.
        SnapshotTooLarge: this rank's part does not fit the free shared memory; nothing was overwritten.
        TypeError: an item cannot be saved (a tensor on the meta device).
    """

    def __init__(self, step: int | None = None) -> None:
        super().__init__()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be an int >= 0, not {step!r}")
        self._given = step
        self.step: int | None = step
        self._rank = int(os.environ.get("RANK", "0") or 0)
        self._world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._local_items: list | None = None
        self._fs: FileSystemWriter | None = None
        self._checkpoint_id = None
        self.path: str | None = None  #: the slot file (or DCP directory) the last save wrote

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Take the ``checkpoint_id`` of the next save (``dcp.save`` calls it only when it was given one)."""
        self._checkpoint_id = checkpoint_id

    @property
    def checkpoint_id(self):
        return self._checkpoint_id

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
        self._local_items = None
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
        self._local_items = list(plan.items) if plan.usable else None
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._fs is not None:
            return self._fs.prepare_global_plan(plans)
        merged: dict = {}
        for p in plans:
            if isinstance(p.planner_data, dict):
                merged.update(p.planner_data)
        layout = encode_layout([p.items for p in plans], merged)
        return [replace(p, storage_data=layout) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._fs is not None:
            return self._fs.write_data(plan, planner)
        layout = plan.storage_data if isinstance(plan.storage_data, dict) and "fqns" in plan.storage_data else None
        key = f"{type(planner).__module__}.{type(planner).__qualname__}"  # DCP caches plans per planner class too
        if self._local_items is not None:
            _LAST_LOCAL_ITEMS[key] = self._local_items
        items = _LAST_LOCAL_ITEMS.get(key, list(plan.items))
        if layout is None:  # a planner that dropped the storage data: this rank's own layout (still readable here)
            layout = {**encode_layout([items], plan.planner_data or {}), "partial": True}
        saved, results = [], []
        in_plan = {wi.index for wi in plan.items}
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                saved.append([item.index.fqn, None, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                              if raw else torch.empty(0, dtype=torch.uint8), item.index in in_plan])
                nbytes = len(raw)
            else:
                t = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(data)
                saved.append([item.index.fqn, list(item.index.offset), t, item.index in in_plan])
                nbytes = t.numel() * t.element_size()
            if item.index in in_plan:
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        state = {"format": FORMAT, "rank": self._rank, "world_size": self._world, "layout": layout, "items": saved}
        self.path = _commit(state, self.step, rank=self._rank, world_size=self._world)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing in memory (each rank committed its part in ``write_data``). Without elaunch: the DCP
        directory's ``.metadata`` (coordinator), then, in the default directory, the removal of the steps
        older than the complete one before this (two complete steps stay)."""
        if self._fs is None:
            return
        self._fs.finish(metadata, results)
        if not _is_path(self._checkpoint_id):  # the default directory: keep this step and the complete one before
            from elaunch.checkpoint import persisted

            before = persisted.newest_dcp(_local_dir(), self.step - 1)
            if before is not None:
                persisted.prune_dcp(_local_dir(), before[0])

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: DCP never picks this writer by itself; pass it as ``storage_writer``."""
        return False

    def storage_meta(self):
        return self._fs.storage_meta() if self._fs is not None else None


def _commit(state: dict, step: int, *, rank: int, world_size: int) -> str:
    """Copy ``state`` into this local rank's slot that does not hold its newest commit, flagged reshardable.

    Raises:
        SnapshotTooLarge: it does not fit the free shared memory; nothing is written.
        CheckpointError: the agent's directory is gone.
    """
    from elaunch.checkpoint import _shm as shm_mod

    return shm_mod.save(state, step, replicated=False, reshardable=True, shm_dir=_shm(),
                        local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0), rank=rank, world_size=world_size)


# -- the reader ------------------------------------------------------------------------------------------------

@dataclass
class _Part:
    """One snapshot file of the step: its header, its items (fqn, offsets or None) -> TensorRef."""

    info: slotfile.SlotInfo
    refs: dict[tuple, Any]
    layout: dict


def _open_part(path: str, step: int) -> _Part | None:
    """The DCP snapshot of ``step`` in ``path`` (header and meta only), or None (another step, not DCP, torn,
    or rewritten while its meta was read: the meta is copied under the slot's sequence lock)."""
    from elaunch.checkpoint import _tree

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < slotfile.HEADER_SIZE:
            return None
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            info = slotfile.parse(mm, path, fd)
            if info is None or info.step != step or not info.reshardable:
                return None
            meta = bytes(mm[slotfile.META_AT:slotfile.META_AT + info.meta_len])
            if not slotfile.still(mm, info, fd):
                return None
    finally:
        os.close(fd)
    made: dict[int, Any] = {}

    def make(ref):
        t = torch.empty(0)
        made[id(t)] = ref
        return t

    state = _tree.unpack(meta, make, _ALL, data_len=info.data_len, source=f"the DCP snapshot {path} (step {step})")
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        return None
    refs = {}
    for fqn, offsets, t, *_planned in state["items"]:
        refs[(fqn, None if offsets is None else tuple(offsets))] = made[id(t)]
    return _Part(info, refs, state["layout"])


class _All:
    def __contains__(self, _: object) -> bool:
        return True


_ALL = _All()


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
        CheckpointError: nothing to load (``step`` is None), a chunk of the layout is in none of
            this node's snapshots (named), or a snapshot was rewritten while it was read.
        UnsafeStateError: a snapshot's structure needs a class weights-only loading does not allow.
    """

    def __init__(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().__init__()
        self._index: dict[tuple, tuple[_Part, Any]] = {}
        self._unopened: list[str] = []
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
        """The layout of the step to load, with each chunk's holder among this node's snapshots.

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
        # The agent's file for this rank first: its part holds the job's whole layout and, at an unchanged world
        # size, every chunk this rank loads. Other parts are opened only when the layout needs them (a part of
        # its own rank's layout only) or, in prepare_local_plan, when the rank's plan asks for chunks the opened
        # ones lack (resharding): unpickling a part's structure costs milliseconds per hundred tensors.
        parts: list[_Part] = []
        while files and not any(not p.layout.get("partial") for p in parts):
            f = files.pop(0)
            part = _open_part(f, self.step)
            if part is not None:
                parts.append(part)
        if not parts:
            raise CheckpointError(f"no DCP snapshot of step {self.step} is on this node ({_shm()}); the agent chose "
                                  f"{self._restore}")
        whole = [p for p in parts if not p.layout.get("partial")]
        layout = whole[0].layout if whole else {"fqns": {}, "planner_data": {}}
        if not whole:  # every part holds its own rank's layout only: the union is all that is known
            for p in parts:
                for fqn, e in p.layout["fqns"].items():
                    got = layout["fqns"].setdefault(fqn, e[:3] + [[]] if e[0] == "tensor" else e)
                    if e[0] == "tensor":
                        got[3] += [c for c in e[3] if c not in got[3]]
        metadata = decode_layout(layout)
        self._index, self._unopened = {}, files
        for p in sorted(parts, key=lambda p: p.info.rank != self._rank):  # this rank's own part first
            self._add(p)
        metadata.storage_data = {
            MetadataIndex(fqn, key[1]): key for fqn, md in metadata.state_dict_metadata.items()
            for key in ([(fqn, None)] if isinstance(md, BytesStorageMetadata) else
                        [(fqn, tuple(c.offsets)) for c in md.chunks])}
        # a chunk this node lacks is an error only when this rank's load plan asks for it (prepare_local_plan):
        # at an unchanged world size each rank is given its own part alone, and other nodes' parts are not here
        return metadata

    def _add(self, part: _Part) -> None:
        """Make ``part``'s chunks readable (a chunk already held by a part added before stays with that one)."""
        for key, ref in part.refs.items():
            self._index.setdefault(key, (part, ref))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._fs is not None:
            self._fs.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan as it is, once every chunk it asks for is in one of this node's snapshots.

        Raises:
            CheckpointError: some are in none (named): nothing is loaded.
        """
        if self._fs is not None:
            return self._fs.prepare_local_plan(plan)
        from elaunch.checkpoint import CheckpointError

        def lacking() -> list[tuple]:
            keys = [(req.storage_index.fqn, None if req.type == LoadItemType.BYTE_IO
                     else tuple(req.storage_index.offset)) for req in plan.items]
            return list(dict.fromkeys(k for k in keys if k not in self._index))

        missing = lacking()
        while missing and self._unopened:  # open this node's other parts of the step until none is missing
            f = self._unopened.pop(0)
            part = _open_part(f, self.step)
            if part is not None:
                self._add(part)
                missing = lacking()
        missing = [f"{fqn} at {list(offsets) if offsets is not None else 'bytes'}" for fqn, offsets in missing]
        if missing:
            raise CheckpointError(
                f"step {self.step}: {len(missing)} chunk(s) this rank loads are in none of this node's snapshots "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): the agent did not gather every "
                f"rank's part; nothing was loaded")
        return plan

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
            key = (req.storage_index.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(req.storage_index.offset))
            part, ref = self._index[key]
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
    from elaunch.checkpoint import persisted

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
