"""A state as a pickle of its structure plus a list of tensors: the meta of a snapshot.

The structure is pickled once (protocol 2, as ``torch.save`` does), with every tensor
replaced by a reference (pickle's ``persistent_id``, the way ``torch.save`` does it), so
the container types a state uses come back as they were (dict, OrderedDict with its
``_metadata``, list, tuple, and the types torch's weights-only unpickler allows), and a
tensor that appears twice comes back as one tensor. The tensors' bytes go elsewhere (the
data of a slot); a reference says where: its offset into the data (64-byte aligned), its
byte count, dtype, shape, original device and whether it required grad.

**Loading never runs code from the meta.** A snapshot may come from a peer node (a
replica), so the meta is unpickled by torch's own weights-only unpickler
(``torch._weights_only_unpickler``, what ``torch.load(weights_only=True)`` uses): tensors,
primitive types, containers, the types torch allows, and the classes a user allowed with
``torch.serialization.add_safe_globals`` (or its ``safe_globals`` context manager).
Anything else raises :class:`elaunch.checkpoint.UnsafeStateError`, naming the class. A
reference is therefore a tuple of primitives, which that unpickler accepts as a
persistent id: ``("storage", "elaunch.t2", offset, nbytes, dtype, shape, device, grad,
index)`` (the first item must be ``"storage"`` for torch's unpickler).

A DTensor (FSDP2's ``fully_shard``, tensor parallelism; sharded state only,
``replicated=False``) is saved as its rank's local shard with a reference tagged
``"elaunch.dt1"``: the nine items above (of the local shard), then the global shape and
stride, the placements (``("S", dim)``, ``("SS", dim, split_factor)`` for a
``_StridedShard``, ``("R",)``, ``("P", reduce_op)``) and the device mesh (:func:`encode_mesh`:
device type, shape, dimension names, the global ranks of its layout, the world size, and
the same for the mesh it was sliced from), all primitives. Loading makes it a DTensor
again on a mesh rebuilt from these (:class:`DTensorMaker`), at the saved world size only.
In ``torch.save`` files (the persisted layout) a DTensor is written as a plain dict of the
same primitives and its local shard (:func:`encode_dtensors`), which any
``torch.load(weights_only=True)`` reads without a process group.

:func:`pack` checks at save time that the meta will load under these rules (again only when
the kinds of objects in the state change), so a state that could not be restored fails at its first
save with a ``TypeError`` naming its key path, not at the restore.

Imported only from inside ``elaunch.checkpoint``'s functions: it imports torch.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from types import BuiltinFunctionType, FunctionType
from typing import Any

import torch
from torch import _weights_only_unpickler as _wo

#: every tensor's bytes start on a multiple of this in the data
TENSOR_ALIGN = 64
#: the pickle protocol of the meta: torch.save's; the weights-only unpickler knows its opcodes only
PROTOCOL = 2
_STORAGE = "storage"
_TAG = "elaunch.t2"  # elaunch.t (format 1) pickled a TensorRef object: refused now, as any class is
_DT_TAG = "elaunch.dt1"  # a DTensor's local shard, its placements, global shape and stride, and its mesh
#: the key that marks a DTensor written into a torch.save file as a dict of primitives (:func:`encode_dtensors`)
DTENSOR_KEY = "elaunch.dtensor"
#: Partial's reduce ops a reference may name
_REDUCE_OPS = frozenset({"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"})
#: dtype name (``"bfloat16"``) -> dtype, for the names a reference may carry (nothing else is looked up)
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
#: modules whose globals torch's weights-only unpickler refuses even when allow-listed
_BLOCKED = tuple(getattr(_wo, "_blocklisted_modules", ()))


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of a snapshot lies in the data, and what it was.

    In the meta a reference is the tuple :meth:`pid` returns (primitives only).

    Attributes:
        offset: byte offset into the data (a multiple of :data:`TENSOR_ALIGN`).
        nbytes: its byte count (``numel * element_size``).
        dtype: the dtype's name in ``torch`` (``"bfloat16"``).
        shape: its shape.
        device: the device it was on when saved (``"cpu"``, ``"cuda:0"``).
        grad: bit 0: it required grad; bit 1: it was an ``nn.Parameter``.
        index: its place among the snapshot's tensors (one per tensor object saved).
        dt: for a DTensor (then the fields above describe its local shard):
            ``(global_shape, global_stride, placements, mesh)``, primitives (see the module's text);
            None for a plain tensor.
    """

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    grad: int = 0
    index: int = 0
    dt: tuple | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def pid(self) -> tuple:
        """The persistent id that stands for the tensor in the meta."""
        if self.dt is not None:
            return (_STORAGE, _DT_TAG, self.offset, self.nbytes, self.dtype, self.shape, self.device, self.grad,
                    self.index, *self.dt)
        return (_STORAGE, _TAG, self.offset, self.nbytes, self.dtype, self.shape, self.device, self.grad, self.index)

    @classmethod
    def from_pid(cls, pid: Any, data_len: int | None = None) -> TensorRef:
        """The reference a persistent id read from a meta stands for, checked field by field.

        Raises:
            pickle.UnpicklingError: ``pid`` is not a well-formed reference (a forged or
                foreign meta), or its bytes lie beyond ``data_len``.
        """
        plain = type(pid) is tuple and len(pid) == 9 and pid[:2] == (_STORAGE, _TAG)
        if not (plain or type(pid) is tuple and len(pid) == 13 and pid[:2] == (_STORAGE, _DT_TAG)):
            raise pickle.UnpicklingError(f"not an elaunch tensor reference: persistent id {pid!r:.200}")
        offset, nbytes, dtype, shape, device, grad, index = pid[2:9]
        dt = None if plain else tuple(pid[9:])
        ints = (offset, nbytes, grad, index)
        ok = (all(type(v) is int and v >= 0 for v in ints) and grad <= 3 and type(dtype) is str and dtype in _DTYPES
              and _is_shape(shape) and type(device) is str
              and nbytes == math.prod(shape) * _DTYPES[dtype].itemsize
              and (data_len is None or offset + nbytes <= data_len) and (dt is None or _dt_ok(dt, len(shape))))
        if not ok:
            raise pickle.UnpicklingError(f"a malformed tensor reference in the meta: {pid!r:.200}")
        return cls(offset, nbytes, dtype, shape, device, grad, index, dt)


def _is_shape(shape: Any, positive: bool = False) -> bool:
    return type(shape) is tuple and all(type(n) is int and n >= int(positive) for n in shape)


def _placement_ok(p: Any, ndim: int) -> bool:
    if type(p) is not tuple or not p or type(p[0]) is not str:
        return False
    if p[0] == "R":
        return len(p) == 1
    if p[0] == "P":
        return len(p) == 2 and type(p[1]) is str and p[1] in _REDUCE_OPS
    if p[0] in ("S", "SS"):
        ints = p[1:]
        return (len(p) == (2 if p[0] == "S" else 3) and all(type(v) is int for v in ints) and 0 <= p[1] < ndim
                and all(v >= 1 for v in ints[1:]))
    return False


def mesh_ok(mesh: Any, root: bool = False) -> bool:
    """True when ``mesh`` is a well-formed encoding of a device mesh (:func:`encode_mesh`)."""
    if not (type(mesh) is tuple and len(mesh) == 6):
        return False
    device_type, shape, names, ranks, world, parent = mesh
    return (type(device_type) is str and _is_shape(shape, positive=True) and len(shape) >= 1
            and (names is None or type(names) is tuple and len(names) == len(shape)
                 and all(type(n) is str for n in names))
            and type(world) is int and world >= 1 and _is_shape(ranks) and len(ranks) == math.prod(shape)
            and all(r < world for r in ranks)
            and (parent is None if root else parent is None or mesh_ok(parent, root=True) and parent[4] == world))


def _dt_ok(dt: tuple, local_ndim: int) -> bool:
    """True when ``dt`` (a DTensor reference's last four items) is well formed for a local shard of ``local_ndim``."""
    if len(dt) != 4:
        return False
    shape, stride, placements, mesh = dt
    return (_is_shape(shape) and len(shape) == local_ndim and _is_shape(stride) and len(stride) == len(shape)
            and mesh_ok(mesh) and type(placements) is tuple and len(placements) == len(mesh[1])
            and all(_placement_ok(p, len(shape)) for p in placements))


@dataclass
class Packed:
    """A state taken apart: ``meta`` (bytes of the pickle), the tensors and their places."""

    meta: bytes
    tensors: list[tuple[torch.Tensor, TensorRef]] = field(default_factory=list)
    data_len: int = 0


class _Unsupported(TypeError):
    """A tensor that cannot go into a snapshot (sparse, quantized, on the meta device, a DTensor)."""


def _distributed_kind(t: torch.Tensor) -> str | None:
    """``"DTensor"`` or ``"ShardedTensor"`` when ``t`` is one (found by class, without importing torch.distributed)."""
    for cls in type(t).__mro__:
        if cls.__module__.startswith("torch.distributed") and cls.__name__ in ("DTensor", "ShardedTensor",
                                                                               "ShardedTensorBase"):
            return "ShardedTensor" if cls.__name__.startswith("Sharded") else "DTensor"
    return None


#: torch's sub-byte "shell" dtypes (uint1..uint7, int1..int7): no operation copies them
_SHELL_DTYPES = frozenset(f"{sign}int{bits}" for sign in ("u", "") for bits in range(1, 8))


def _check_tensor(t: torch.Tensor, replicated: bool) -> None:
    kind = _distributed_kind(t)
    if kind is None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        cls = type(t)
        raise _Unsupported(
            f"a tensor subclass ({cls.__module__}.{cls.__qualname__}) would not come back as one (a snapshot "
            f"restores plain tensors, and a torch.save file may not load weights-only): save its plain data "
            f"(t.as_subclass(torch.Tensor), or the subclass's own tensors), or save it with "
            f"torch.distributed.checkpoint")
    if kind is not None and replicated:
        raise _Unsupported(
            f"a {kind} is one rank's part of a tensor spread over ranks (FSDP2, tensor parallelism), not the same "
            f"on every rank, so it cannot be saved as replicated state (replicated=True, the default). "
            + ("Save it with ckpt.save(state, step, replicated=False): each rank keeps its own shard, restored at "
               "the same world size (torch.distributed.checkpoint reshards). " if kind == "DTensor" else "")
            + "If every rank should hold the whole state, save full tensors instead (get_state_dict(..., "
              "options=StateDictOptions(full_state_dict=True)), or DTensor.full_tensor())")
    if kind == "ShardedTensor":
        raise _Unsupported(
            "a ShardedTensor (the deprecated torch.distributed._shard API) cannot be saved in a snapshot: use "
            "DTensors (FSDP2, tensor parallelism) with replicated=False, or save it with "
            "torch.distributed.checkpoint (dcp.save)")
    local = t._local_tensor if kind == "DTensor" else t
    if str(local.dtype).removeprefix("torch.") in _SHELL_DTYPES:
        raise _Unsupported(f"dtype {local.dtype} is one of torch's shell dtypes, which no torch operation copies: save "
                           f"the packed bytes (t.view(torch.uint8)) or the tensor subclass's own data")
    if local.layout != torch.strided or local.is_quantized or local.device.type == "meta":
        raise _Unsupported(f"only dense tensors with storage can be saved, not layout={local.layout}, "
                           f"quantized={local.is_quantized}, device={local.device}"
                           + (" (the local shard of a DTensor)" if local is not t else ""))


# ---------------------------------------------------------------- DTensors as primitives


def encode_placement(p: Any) -> tuple:
    """A DTensor placement as primitives: ``("S", dim)``, ``("SS", dim, split_factor)``, ``("R",)``, ``("P", op)``.

    Raises:
        TypeError: a placement of another kind.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # an older torch
        _StridedShard = ()
    if _StridedShard and isinstance(p, _StridedShard):
        return ("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return ("S", int(p.dim))
    if isinstance(p, Replicate):
        return ("R",)
    if type(p) is Partial:  # a subclass (MaskPartial) holds more than its reduce op
        return ("P", str(p.reduce_op))
    raise _Unsupported(f"a DTensor placed as {p!r} cannot be saved: Shard, Replicate and Partial placements only")


def decode_placement(p: tuple) -> Any:
    """The placement :func:`encode_placement` encoded (``p`` already checked well formed)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if p[0] == "S":
        return Shard(p[1])
    if p[0] == "SS":
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(p[1], split_factor=p[2])
    return Replicate() if p[0] == "R" else Partial(p[1])


def encode_mesh(mesh: Any, parent: bool = True) -> tuple:
    """A device mesh as primitives: ``(device_type, shape, dim_names, ranks, world_size, root)``.

    ``ranks``: the global ranks of its layout, row-major; ``world_size``: the default
    group's; ``root``: the same tuple (its own root None) for the mesh it was sliced from
    (``mesh_2d["dp"]``), None when it is its own root.
    """
    import torch.distributed as dist

    root = mesh._get_root_mesh() if parent and hasattr(mesh, "_get_root_mesh") else mesh
    names = None if mesh.mesh_dim_names is None else tuple(str(n) for n in mesh.mesh_dim_names)
    return (str(mesh.device_type), tuple(int(n) for n in mesh.shape), names,
            tuple(int(r) for r in mesh.mesh.flatten().tolist()), dist.get_world_size(),
            None if root is mesh else encode_mesh(root, parent=False))


def dtensor_info(t: Any, meshes: dict[int, tuple] | None = None) -> tuple:
    """The ``dt`` of a :class:`TensorRef` for the DTensor ``t``: global shape and stride, placements, mesh.

    ``meshes``: encodings already made, by ``id`` of the mesh (the same tuple object for
    the same mesh, so the pickle holds it once).
    """
    mesh = t.device_mesh
    if meshes is None:
        meshes = {}
    enc = meshes.get(id(mesh))
    if enc is None:
        enc = meshes[id(mesh)] = encode_mesh(mesh)
    return (tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride()),
            tuple(encode_placement(p) for p in t.placements), enc)


class DTensorMaker:
    """Makes DTensors from local shards and their references' ``dt``, on meshes rebuilt once per load.

    Args:
        mesh: None (rebuild each saved mesh with ``init_device_mesh``, slicing a
            sub-mesh out of its rebuilt root by its dimension names), or a ``DeviceMesh``
            or a list of them to use instead (each DTensor takes the one whose device type,
            shape, dimension names and ranks are the saved mesh's).
    """

    def __init__(self, mesh: Any = None):
        self.given = [] if mesh is None else list(mesh) if isinstance(mesh, (list, tuple)) else [mesh]
        self._meshes: dict[tuple, Any] = {}

    def __call__(self, local: torch.Tensor, ref: TensorRef) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        shape, stride, placements, mesh = ref.dt
        dt = DTensor.from_local(local, self.mesh(mesh), [decode_placement(p) for p in placements],
                                run_check=False, shape=torch.Size(shape), stride=stride)
        return _with_grad(dt, ref.grad)

    def mesh(self, enc: tuple) -> Any:
        """The device mesh for the saved one ``enc`` (well formed), found or rebuilt.

        Raises:
            CheckpointError: the world is another than the saved one, or the mesh cannot
                be rebuilt and none given matches it.
        """
        check_world(enc[4])
        found = self._meshes.get(enc)
        if found is None:
            found = self._meshes[enc] = self._find(enc)
        return found

    def _find(self, enc: tuple) -> Any:
        from elaunch.checkpoint import CheckpointError

        what = (f"the device mesh a DTensor was saved on ({enc[0]}, shape {enc[1]}, dimension names {enc[2]}, "
                f"ranks {_short(enc[3])})")
        if self.given:
            for m in self.given:
                if encode_mesh(m)[:4] == enc[:4]:
                    return m
            raise CheckpointError(f"none of the meshes given to ckpt.load(mesh=...) is {what}")
        root = enc[5] or enc
        mesh = None
        if root[3] == tuple(range(root[4])) and (enc[5] is None or enc[2] is not None):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = self._meshes.get(root)
            if mesh is None:
                mesh = self._meshes[root] = init_device_mesh(root[0], root[1], mesh_dim_names=root[2])
            if enc[5] is not None:
                mesh = mesh[enc[2]]
        if mesh is None or encode_mesh(mesh)[:4] != enc[:4]:
            raise CheckpointError(f"cannot rebuild {what} with init_device_mesh: pass that mesh as "
                                  f"ckpt.load(mesh=...)")
        return mesh


def _short(ranks: tuple) -> str:
    return str(ranks) if len(ranks) <= 8 else f"({', '.join(map(str, ranks[:8]))}, ... {len(ranks)} in all)"


def world_size_now() -> int | None:
    """The default process group's size, or None when ``torch.distributed`` is not initialized."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def check_world(saved: int) -> None:
    """Raise ``CheckpointError`` unless this process is in a world of ``saved`` ranks (``torch.distributed``)."""
    from elaunch.checkpoint import CheckpointError

    now = world_size_now()
    if now != saved:
        here = "torch.distributed is not initialized here" if now is None else f"this run has {now}"
        raise CheckpointError(
            f"the snapshot holds DTensors saved by a world of {saved} ranks and {here}: restore it at {saved} ranks "
            f"(after init_process_group), or reshard it through torch.distributed.checkpoint with "
            f"elaunch.checkpoint.SnapshotReader")


def dtensor_fits(ref: TensorRef, target: Any, meshes: dict[int, tuple] | None = None) -> bool:
    """True when the DTensor ``target`` can take the saved DTensor ``ref`` in place, its local shard in its own.

    Same global shape, dtype, placements and local shape, on a mesh of the saved layout
    (same shape and ranks: this rank holds the same part), in a world of the saved size.
    """
    if _distributed_kind(target) != "DTensor" or ref.dt is None:
        return False
    local = target._local_tensor
    shape, _, placements, mesh = ref.dt
    if not (tuple(target.shape) == shape and target.dtype == ref.torch_dtype and tuple(local.shape) == ref.shape
            and local.layout == torch.strided and local.device.type != "meta" and world_size_now() == mesh[4]):
        return False
    try:
        here = dtensor_info(target, meshes)
    except TypeError:  # a placement that cannot be encoded: not the saved one
        return False
    return here[2] == placements and here[3][1:4] == mesh[1:4] and here[3][0] == mesh[0]


def as_entry(local: torch.Tensor, ref: TensorRef) -> dict:
    """The dict that stands for a DTensor in a ``torch.save`` file: its local shard and the primitives of its reference."""
    shape, stride, placements, mesh = ref.dt
    return {DTENSOR_KEY: _DT_TAG, "local": local, "shape": shape, "stride": stride, "placements": placements,
            "mesh": mesh, "grad": ref.grad}


def _is_entry(obj: Any) -> bool:
    return type(obj) is dict and obj.get(DTENSOR_KEY) == _DT_TAG


def entry_ref(entry: dict) -> TensorRef:
    """The reference an entry (:func:`as_entry`) stands for, checked as a reference in a meta is.

    Raises:
        pickle.UnpicklingError: the entry is malformed.
    """
    local = entry.get("local")
    if not isinstance(local, torch.Tensor) or _distributed_kind(local) is not None or set(entry) != {
            DTENSOR_KEY, "local", "shape", "stride", "placements", "mesh", "grad"}:
        raise pickle.UnpicklingError(f"a malformed DTensor entry: {entry!r:.200}")
    dtype = str(local.dtype).removeprefix("torch.")
    return TensorRef.from_pid((_STORAGE, _DT_TAG, 0, local.numel() * local.element_size(), dtype, tuple(local.shape),
                               str(local.device), entry["grad"], 0, entry["shape"], entry["stride"],
                               entry["placements"], entry["mesh"]))


def encode_dtensors(state: Any) -> Any:
    """``state`` with each DTensor reached through dicts, lists and tuples replaced by its entry (:func:`as_entry`).

    For ``torch.save`` files: an entry holds primitives and a plain tensor, which any
    ``torch.load(weights_only=True)`` reads, without a process group. ``state`` is not
    changed: containers on the way to a DTensor are copied (``copy.copy``: an
    OrderedDict keeps its ``_metadata``); a DTensor found twice becomes one entry.
    """
    import copy

    memo: dict[int, Any] = {}
    meshes: dict[int, tuple] = {}

    def walk(obj: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        new = obj
        if isinstance(obj, torch.Tensor):
            if _distributed_kind(obj) == "DTensor":
                grad = (2 if isinstance(obj, torch.nn.Parameter) else 0) | int(obj.requires_grad)
                local = obj._local_tensor.detach()
                ref = TensorRef(0, 0, "", (), "", grad, 0, dtensor_info(obj, meshes))
                new = as_entry(local, ref)
        elif isinstance(obj, dict):
            changed = {k: w for k, v in obj.items() if (w := walk(v)) is not v}
            if changed:
                new = copy.copy(obj)
                new.update(changed)
        elif isinstance(obj, (list, tuple)):
            items = [walk(v) for v in obj]
            if any(a is not b for a, b in zip(items, obj)):
                new = items if isinstance(obj, list) else tuple(items) if type(obj) is tuple else (
                    type(obj)._make(items) if hasattr(type(obj), "_make") else obj)
        memo[id(obj)] = new
        return new

    return walk(state)


@torch.no_grad()
def decode_dtensors(state: Any, make: Callable[[torch.Tensor, TensorRef], Any] | None, into: Any = None) -> Any:
    """``state`` as loaded from a ``torch.save`` file, each DTensor entry (:func:`as_entry`) a DTensor again.

    An entry whose key path in ``into`` holds a DTensor that fits it (:func:`dtensor_fits`)
    is copied into that DTensor's local shard, and that DTensor takes its place; the
    others are made by ``make(local, ref)`` (a :class:`DTensorMaker`), or left as entries
    when ``make`` is None. Dicts and lists are changed in place, tuples rebuilt.

    Raises:
        CheckpointError: an entry is malformed; as ``make`` raises (another world size).
    """
    from elaunch.checkpoint import CheckpointError

    memo: dict[int, Any] = {}
    meshes: dict[int, tuple] = {}

    def walk(obj: Any, target: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        new = obj
        if _is_entry(obj):
            try:
                ref = entry_ref(obj)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(f"cannot load a DTensor: {exc}") from exc
            if dtensor_fits(ref, target, meshes):
                target._local_tensor.copy_(obj["local"])
                new = target
            elif make is not None:
                new = make(obj["local"], ref)
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                w = walk(v, target[k] if isinstance(target, dict) and k in target else None)
                if w is not v:
                    obj[k] = w
        elif isinstance(obj, (list, tuple)):
            tl = target if isinstance(target, (list, tuple)) else ()
            items = [walk(v, tl[i] if i < len(tl) else None) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                obj[:] = items
            elif any(a is not b for a, b in zip(items, obj)):
                new = tuple(items) if type(obj) is tuple else (
                    type(obj)._make(items) if hasattr(type(obj), "_make") else obj)
        memo[id(obj)] = new
        return new

    return walk(state, into)


class _Pickler(pickle.Pickler):
    def __init__(self, file, replicated: bool = True):
        super().__init__(file, protocol=PROTOCOL)
        self.replicated = replicated
        self.packed = Packed(b"")
        self._seen: dict[int, tuple] = {}
        self._meshes: dict[int, tuple] = {}  # id(mesh) -> its encoding, one tuple per mesh (pickled once)
        self._keep: list[Any] = []  # the meshes encoded, alive while their ids are keys
        self.types: set[type] = set()  # of every object pickled (pickle asks persistent_id about each one)

    def persistent_id(self, obj: Any):
        if not isinstance(obj, torch.Tensor):
            # a class or function held as a value is pickled as a global of its own: it is the key, not its type
            self.types.add(obj if isinstance(obj, (type, FunctionType, BuiltinFunctionType)) else type(obj))
            return None
        pid = self._seen.get(id(obj))
        if pid is None:
            _check_tensor(obj, self.replicated)
            pid = self._seen[id(obj)] = self._place(obj).pid()
        return pid

    def _place(self, t: torch.Tensor) -> TensorRef:
        p = self.packed
        grad = (2 if isinstance(t, torch.nn.Parameter) else 0) | int(t.requires_grad)
        dt = None
        if _distributed_kind(t) == "DTensor":  # its local shard goes to the data, the rest into the reference
            self._keep.append(t.device_mesh)
            dt = dtensor_info(t, self._meshes)
            t = t._local_tensor
        nbytes = t.numel() * t.element_size()
        ref = TensorRef(p.data_len, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape), str(t.device), grad,
                        len(p.tensors), dt)
        p.tensors.append((t, ref))
        p.data_len += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
        return ref


def _dump(obj: Any, replicated: bool = True) -> _Pickler:
    buf = io.BytesIO()
    pickler = _Pickler(buf, replicated)
    pickler.dump(obj)
    pickler.packed.meta = buf.getvalue()
    return pickler


def pack(state: Any, replicated: bool = True, check: bool = True) -> Packed:
    """Pickle ``state``'s structure with its tensors replaced by references (:class:`TensorRef`).

    Args:
        state: a nested container of tensors and picklable leaves.
        replicated: as ``ckpt.save``'s; only the message about a DTensor depends on it.
        check: also make sure the meta loads under the weights-only rules (:func:`check_loads`).

    Returns:
        Packed: the meta bytes, each tensor (as given, possibly non-contiguous or on
        a GPU) with its reference, and the bytes of data they need.

    Raises:
        TypeError: a leaf cannot be pickled, a tensor cannot be saved (sparse,
            quantized, a DTensor or ShardedTensor), or a leaf would not load under the
            weights-only rules; the message names the leaf's key path, e.g.
            ``state['optimizer']['param_groups'][0]['fn']``, and what to do.
    """
    try:
        pickler = _dump(state, replicated)
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        path, leaf, why = find_bad_leaf(state, exc, lambda obj: _leaf_error(obj, replicated))
        raise TypeError(f"elaunch.checkpoint.save: cannot save {path} (a {type(leaf).__name__}): {why}") from exc
    if check:
        check_loads(pickler.packed.meta, state, pickler.types)
    return pickler.packed


def _leaf_error(obj: Any, replicated: bool = True) -> Exception | None:
    try:
        _dump(obj, replicated)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def find_bad_leaf(state: Any, exc: Exception,
                  fails: Callable[[Any], Exception | None] = _leaf_error) -> tuple[str, Any, Exception]:
    """The key path, the object and the error of the first part of ``state`` for which ``fails`` returns an error.

    Walks dicts (by key), lists and tuples (by index); a leaf is anything else. When no
    leaf fails alone, the innermost container that does is named (``exc`` for the root).
    ``fails`` defaults to "cannot be pickled into a snapshot".
    """
    def walk(obj: Any, path: str):
        if isinstance(obj, dict):
            children = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            children = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        else:
            err = fails(obj)
            return None if err is None else (path, obj, err)
        for child_path, child in children:
            found = walk(child, child_path)
            if found is not None:
                return found
        if type(obj) in (dict, list, tuple):
            return None
        err = fails(obj)  # a container type of its own (a local class, a namedtuple, ...)
        return None if err is None else (path, obj, err)

    return walk(state, "state") or ("state", state, exc)


# ---------------------------------------------------------------- loading: weights-only


def disallowed_globals(pickled: bytes) -> list[str]:
    """The globals (``module.qualname``) a protocol-2 pickle names that weights-only loading does not allow now.

    Reads the opcodes only (``torch._weights_only_unpickler.get_globals_in_pkl``): nothing
    is imported or called. Empty when the pickle cannot be scanned.
    """
    try:
        names = _wo.get_globals_in_pkl(io.BytesIO(pickled))
    except Exception:  # noqa: BLE001 - an opcode the scanner does not know: the unpickler's message says it
        return []
    allowed = set(_wo._get_allowed_globals()) | set(_wo._get_user_allowed_globals())
    return sorted(n for n in names if n not in allowed)


def _shown(name: str) -> str:
    return name.removeprefix("builtins.")  # add_safe_globals([list]), as torch's own message writes it


def how_to_allow(names: list[str], where: str = "in the loading process, before loading") -> str:
    """One sentence: how to let weights-only loading take the globals ``names`` (or that it never will)."""
    blocked = [n for n in names if n.split(".", 1)[0] in _BLOCKED]
    if blocked:
        return (f"{', '.join(blocked)} cannot be allowed: torch's weights-only unpickler refuses module "
                f"{blocked[0].split('.', 1)[0]!r} whatever is allow-listed (ckpt.save never writes it)")
    if not names:
        return ("torch's weights-only unpickler cannot rebuild it, whatever is allowed (its reason follows): save "
                "plain types instead (dict(x), list(x): dicts, lists, tuples, numbers, strings, tensors)")
    listed = ", ".join(map(_shown, names))
    them = "it" if len(names) == 1 else "them"
    return (f"if you trust {them}, allow {them} {where}: torch.serialization.add_safe_globals([{listed}]) (or "
            f"`with torch.serialization.safe_globals([{listed}]):`), as for torch.load(weights_only=True); "
            f"or save plain types instead (dicts, lists, tuples, numbers, strings, tensors)")


class _Unpickler(_wo.Unpickler):
    """torch's weights-only unpickler, whose persistent ids are elaunch tensor references.

    ``dtensors(local, ref)`` makes what a DTensor reference stands for from its local
    shard (default: a :class:`DTensorMaker` made at the first one).
    """

    def __init__(self, file, make: Callable[[TensorRef], torch.Tensor], as_is: Container[int] = (),
                 data_len: int | None = None, dtensors: Callable[[torch.Tensor, TensorRef], Any] | None = None):
        super().__init__(file, encoding="utf-8")
        self._make = make
        self._as_is = as_is
        self._data_len = data_len
        self._dtensors = dtensors
        self._made: dict[int, torch.Tensor] = {}
        self.make_failed: BaseException | None = None

    def persistent_load(self, pid):
        ref = TensorRef.from_pid(pid, self._data_len)
        t = self._made.get(ref.index)
        if t is None:
            try:
                t = self._make(ref)
                if ref.index in self._as_is:
                    pass
                elif ref.dt is not None:
                    if self._dtensors is None:
                        self._dtensors = DTensorMaker()
                    t = self._dtensors(t, ref)
                else:
                    t = _with_grad(t, ref.grad)
            except BaseException as exc:
                self.make_failed = exc  # the reader's own error (I/O, CUDA, another world size), not the meta's
                raise
            self._made[ref.index] = t
        return t


def _with_grad(t: torch.Tensor, grad: int) -> torch.Tensor:
    if grad & 2:
        return torch.nn.Parameter(t, requires_grad=bool(grad & 1))
    if grad & 1:
        t.requires_grad_(True)
    return t


def _meta_tensor(ref: TensorRef) -> torch.Tensor:
    return torch.empty(ref.shape, dtype=ref.torch_dtype, device="meta")


def _load(unpickler: _Unpickler) -> Any:
    state = unpickler.load()
    torch._utils._validate_loaded_sparse_tensors()  # as torch.load does after its weights-only unpickler
    return state


def unpack(meta: bytes, make: Callable[[TensorRef], torch.Tensor], as_is: Container[int] = (), *,
           data_len: int | None = None, source: str = "the snapshot",
           dtensors: Callable[[torch.Tensor, TensorRef], Any] | None = None) -> Any:
    """The state whose structure ``meta`` holds, each tensor made by ``make(ref)``.

    Unpickles ``meta`` as ``torch.load(weights_only=True)`` does (torch's weights-only
    unpickler; the classes allowed are torch's and those of
    ``torch.serialization.get_safe_globals()``), whoever wrote it: no code named by the
    meta runs. A tensor whose ``ref.index`` is in ``as_is`` is put in the state as
    ``make`` returned it; the others become an ``nn.Parameter`` or require grad as the
    saved tensor did. A DTensor reference's local shard (``make`` makes it) becomes
    ``dtensors(local, ref)``: by default a DTensor (:class:`DTensorMaker`, which needs
    ``torch.distributed`` initialized at the saved world size); :func:`as_entry` makes the
    dict a ``torch.save`` file holds instead.

    Args:
        meta: the pickle (protocol 2) :func:`pack` made.
        make: builds the tensor a reference stands for; what it raises passes through.
        as_is: indices of tensors to leave as ``make`` returned them.
        data_len: bytes of data the references may point into (None: not checked).
        source: what the meta came from, for messages (``"the snapshot /dev/shm/.../0.1"``).
        dtensors: makes what a DTensor reference stands for; None: a :class:`DTensorMaker`.

    Raises:
        UnsafeStateError: the meta names a class weights-only loading does not allow
            (the message names it and how to allow it), or holds a malformed reference.
        CheckpointError: the meta is not a pickle this unpickler can read (a forged or
            foreign file), or an allowed class's ``__setstate__`` failed; it holds
            DTensors saved at another world size (:func:`check_world`).
    """
    from elaunch.checkpoint import CheckpointError, UnsafeStateError

    unpickler = _Unpickler(io.BytesIO(meta), make, as_is, data_len, dtensors)
    try:
        return _load(unpickler)
    except Exception as exc:
        if exc is unpickler.make_failed:
            raise
        if isinstance(exc, pickle.UnpicklingError):
            names = disallowed_globals(meta)
            what = f"it needs {', '.join(map(_shown, names))}, which" if names else "it holds what"
            raise UnsafeStateError(
                f"cannot load {source}: {what} weights-only loading (as torch.load(weights_only=True)) does not "
                f"allow: {how_to_allow(names)}. ({exc})") from exc
        raise CheckpointError(f"cannot load {source}: its structure does not unpickle ({type(exc).__name__}: "
                              f"{exc})") from exc


#: what the last state this process found loadable held: the types of its objects and the classes allowed then
_CHECKED: list[Any] = [None]


class _Skeleton(_Unpickler):
    """The weights-only unpickler that makes no tensors (None stands for each): for checks only."""

    def persistent_load(self, pid):
        TensorRef.from_pid(pid)
        return None


def _weights_only_error(pickled: bytes) -> pickle.UnpicklingError | None:
    """The error weights-only loading of ``pickled`` meets (no tensor made: None stands for each), or None."""
    try:
        _load(_Skeleton(io.BytesIO(pickled), _meta_tensor))
    except pickle.UnpicklingError as exc:
        return exc
    except Exception:  # noqa: BLE001 - an allowed class's __setstate__ given None for a tensor: not our rule
        return None
    return None


def _leaf_unsafe(obj: Any) -> Exception | None:
    try:
        return _weights_only_error(_dump(obj).packed.meta)
    except Exception:  # noqa: BLE001 - found unpicklable alone: pack named those already
        return None


def check_loads(meta: bytes, state: Any, types: set[type] | None = None) -> None:
    """Raise ``TypeError`` unless ``meta`` (of ``state``) loads under the weights-only rules of :func:`unpack`.

    ``types``: the types of every object pickled into ``meta`` (:class:`_Pickler` collects
    them). The check (the weights-only unpickler over the meta, about 25 ms for 1,152
    tensors on a 2-core machine) runs only when these types or the classes allowed with
    ``torch.serialization.add_safe_globals`` differ from those of the last state found
    loadable: a save whose state holds the same kinds of objects as the last one
    (numbers changed: a step, a learning rate) costs a set comparison. It is an early
    warning, not the guard: :func:`unpack` enforces the rule at every load.

    Raises:
        TypeError: names the first leaf (by key path) that would not load, the class it
            needs, and how to allow it (``torch.serialization.add_safe_globals``).
    """
    key = None if types is None else (frozenset(types), frozenset(_wo._get_safe_globals()))
    if key is not None and key == _CHECKED[0]:
        return
    err = _weights_only_error(meta)
    if err is None:
        _CHECKED[0] = key
        return
    path, leaf, why = find_bad_leaf(state, err, _leaf_unsafe)
    leaf_names = disallowed_globals(_dump(leaf).packed.meta) if path != "state" else []
    names = leaf_names or disallowed_globals(meta)
    needs = f"it needs {', '.join(map(_shown, names))}, which" if names else "it holds what"
    hint = how_to_allow(names, "in the saving and the loading process")
    raise TypeError(
        f"elaunch.checkpoint.save: {path} (a {type(leaf).__name__}) would not load: {needs} weights-only loading "
        f"(as torch.load(weights_only=True)) does not allow. {hint[0].upper()}{hint[1:]}. Nothing was written. "
        f"({why})") from err


def twin(saved: Any, target: Any) -> bool:
    """True when ``target`` can take ``saved``'s values in place: a dense tensor of its shape and dtype.

    Two DTensors are twins when ``target`` fits ``saved`` as :func:`dtensor_fits` says
    (the values go from local shard to local shard); a DTensor and a plain tensor never are.
    """
    if not (isinstance(saved, torch.Tensor) and isinstance(target, torch.Tensor)):
        return False
    kind = _distributed_kind(saved)
    if kind != _distributed_kind(target):
        return False
    if kind == "DTensor":
        return saved is target or dtensor_fits(TensorRef(0, 0, str(saved.dtype).removeprefix("torch."),
                                                         tuple(saved._local_tensor.shape), "", 0, 0,
                                                         dtensor_info(saved)), target)
    return (target.layout == torch.strided and target.device.type != "meta" and target.shape == saved.shape
            and target.dtype == saved.dtype)


def graft(saved: Any, target: Any, take: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          fits: Callable[[Any, Any], bool] = twin) -> Any:
    """``saved`` with each tensor that ``fits`` (a :func:`twin`) at its key path in ``target`` replaced by ``take(it, twin)``.

    Key paths run through dicts (by key), lists and tuples (by index) on both sides, the
    way :func:`find_bad_leaf` names them; tensors inside other objects are left as they
    are. Dicts and lists are changed in place; tuples (namedtuples too) are rebuilt.
    """
    if isinstance(saved, torch.Tensor):
        return take(saved, target) if fits(saved, target) else saved
    if isinstance(saved, dict) and isinstance(target, dict):
        for key, value in list(saved.items()):
            if key in target:
                new = graft(value, target[key], take, fits)
                if new is not value:
                    saved[key] = new
        return saved
    if not (isinstance(saved, (list, tuple)) and isinstance(target, (list, tuple))):
        return saved
    items = [graft(a, b, take, fits) for a, b in zip(saved, target)] + list(saved[len(target):])
    if all(a is b for a, b in zip(items, saved)):
        return saved
    if isinstance(saved, list):
        saved[:] = items
        return saved
    if type(saved) is tuple:
        return tuple(items)
    make = getattr(type(saved), "_make", None)  # a namedtuple
    return make(items) if make is not None else saved


def match(meta: bytes, into: Any) -> dict[int, torch.Tensor]:
    """Which saved tensors (by ``ref.index``) have a :func:`twin` at their key path in ``into``, and that twin.

    The structure is unpickled once (weights-only, as :func:`unpack`) with tensors on the meta device (no data). A saved
    tensor found at several key paths takes the twin of the first. A state whose
    unpickling needs its tensors' data (a user's object reading them in ``__setstate__``)
    matches nothing: all of it is restored into fresh tensors. A saved DTensor's twin is
    a DTensor that fits it (:func:`dtensor_fits`); its local shard takes the saved one.
    """
    refs: dict[int, TensorRef] = {}  # id of the meta tensor standing for a DTensor -> its reference

    def stand_in(local: torch.Tensor, ref: TensorRef) -> torch.Tensor:
        t = torch.empty(ref.dt[0], dtype=ref.torch_dtype, device="meta")
        refs[id(t)] = ref
        return t

    unpickler = _Unpickler(io.BytesIO(meta), _meta_tensor, dtensors=stand_in)
    try:
        skeleton = _load(unpickler)
    except Exception:  # noqa: BLE001 - a user's __setstate__ on a meta tensor; an unsafe meta (unpack says why)
        return {}
    index = {id(t): i for i, t in unpickler._made.items()}
    found: dict[int, torch.Tensor] = {}
    meshes: dict[int, tuple] = {}

    def fits(saved: torch.Tensor, target: Any) -> bool:
        ref = refs.get(id(saved))
        if ref is not None:
            return dtensor_fits(ref, target, meshes)
        return _distributed_kind(target) is None and twin(saved, target)

    def take(saved: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        found.setdefault(index[id(saved)], target)
        return saved

    graft(skeleton, into, take, fits)
    return found


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds ``t``'s values here: a DTensor's local shard, else ``t``."""
    return t._local_tensor if _distributed_kind(t) == "DTensor" else t


@torch.no_grad()
def copy_into(state: Any, into: Any) -> Any:
    """``state`` (already loaded), each tensor with a :func:`twin` in ``into`` copied into it and replaced by it."""
    def take(saved: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if saved is not target:
            local_of(target).copy_(local_of(saved))
        return target

    return graft(state, into, take)
