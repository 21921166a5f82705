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
    """

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    grad: int = 0
    index: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def pid(self) -> tuple:
        """The persistent id that stands for the tensor in the meta."""
        return (_STORAGE, _TAG, self.offset, self.nbytes, self.dtype, self.shape, self.device, self.grad, self.index)

    @classmethod
    def from_pid(cls, pid: Any, data_len: int | None = None) -> TensorRef:
        """The reference a persistent id read from a meta stands for, checked field by field.

        Raises:
            pickle.UnpicklingError: ``pid`` is not a well-formed reference (a forged or
                foreign meta), or its bytes lie beyond ``data_len``.
        """
        if not (type(pid) is tuple and len(pid) == 9 and pid[:2] == (_STORAGE, _TAG)):
            raise pickle.UnpicklingError(f"not an elaunch tensor reference: persistent id {pid!r:.200}")
        _, _, offset, nbytes, dtype, shape, device, grad, index = pid
        ints = (offset, nbytes, grad, index)
        ok = (all(type(v) is int and v >= 0 for v in ints) and grad <= 3 and dtype in _DTYPES
              and type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape) and type(device) is str
              and nbytes == math.prod(shape) * _DTYPES[dtype].itemsize
              and (data_len is None or offset + nbytes <= data_len))
        if not ok:
            raise pickle.UnpicklingError(f"a malformed tensor reference in the meta: {pid!r:.200}")
        return cls(offset, nbytes, dtype, shape, device, grad, index)


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


def _check_tensor(t: torch.Tensor, replicated: bool) -> None:
    kind = _distributed_kind(t)
    if kind is not None and replicated:
        raise _Unsupported(
            f"a {kind} is one rank's part of a tensor spread over ranks (FSDP2, tensor parallelism), not the same "
            f"on every rank, so it cannot be saved as replicated state (replicated=True, the default). Save "
            f"sharded state with torch.distributed.checkpoint (dcp.save, dcp.async_save): in-memory snapshots do "
            f"not take {kind}s yet. If every rank should hold the whole state, save full tensors instead "
            f"(get_state_dict(..., options=StateDictOptions(full_state_dict=True)), or DTensor.full_tensor())")
    if kind is not None:
        raise _Unsupported(
            f"in-memory snapshots of sharded state (replicated=False) do not take {kind}s yet: save sharded "
            f"state with torch.distributed.checkpoint (dcp.save, dcp.async_save) for now")
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise _Unsupported(f"only dense tensors with storage can be saved, not layout={t.layout}, "
                           f"quantized={t.is_quantized}, device={t.device}")


class _Pickler(pickle.Pickler):
    def __init__(self, file, replicated: bool = True):
        super().__init__(file, protocol=PROTOCOL)
        self.replicated = replicated
        self.packed = Packed(b"")
        self._seen: dict[int, tuple] = {}
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
        nbytes = t.numel() * t.element_size()
        grad = (2 if isinstance(t, torch.nn.Parameter) else 0) | int(t.requires_grad)
        ref = TensorRef(p.data_len, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape), str(t.device), grad,
                        len(p.tensors))
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
    """torch's weights-only unpickler, whose persistent ids are elaunch tensor references."""

    def __init__(self, file, make: Callable[[TensorRef], torch.Tensor], as_is: Container[int] = (),
                 data_len: int | None = None):
        super().__init__(file, encoding="utf-8")
        self._make = make
        self._as_is = as_is
        self._data_len = data_len
        self._made: dict[int, torch.Tensor] = {}
        self.make_failed: BaseException | None = None

    def persistent_load(self, pid):
        ref = TensorRef.from_pid(pid, self._data_len)
        t = self._made.get(ref.index)
        if t is None:
            try:
                t = self._make(ref)
            except BaseException as exc:
                self.make_failed = exc  # the reader's own error (I/O, CUDA), not the meta's
                raise
            t = self._made[ref.index] = t if ref.index in self._as_is else _with_grad(t, ref.grad)
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
           data_len: int | None = None, source: str = "the snapshot") -> Any:
    """The state whose structure ``meta`` holds, each tensor made by ``make(ref)``.

    Unpickles ``meta`` as ``torch.load(weights_only=True)`` does (torch's weights-only
    unpickler; the classes allowed are torch's and those of
    ``torch.serialization.get_safe_globals()``), whoever wrote it: no code named by the
    meta runs. A tensor whose ``ref.index`` is in ``as_is`` is put in the state as
    ``make`` returned it; the others become an ``nn.Parameter`` or require grad as the
    saved tensor did.

    Args:
        meta: the pickle (protocol 2) :func:`pack` made.
        make: builds the tensor a reference stands for; what it raises passes through.
        as_is: indices of tensors to leave as ``make`` returned them.
        data_len: bytes of data the references may point into (None: not checked).
        source: what the meta came from, for messages (``"the snapshot /dev/shm/.../0.1"``).

    Raises:
        UnsafeStateError: the meta names a class weights-only loading does not allow
            (the message names it and how to allow it), or holds a malformed reference.
        CheckpointError: the meta is not a pickle this unpickler can read (a forged or
            foreign file), or an allowed class's ``__setstate__`` failed.
    """
    from elaunch.checkpoint import CheckpointError, UnsafeStateError

    unpickler = _Unpickler(io.BytesIO(meta), make, as_is, data_len)
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
    """True when ``target`` can take ``saved``'s values in place: a dense tensor of its shape and dtype."""
    return (isinstance(saved, torch.Tensor) and isinstance(target, torch.Tensor) and target.layout == torch.strided
            and target.device.type != "meta" and target.shape == saved.shape and target.dtype == saved.dtype)


def graft(saved: Any, target: Any, take: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """``saved`` with each tensor that has a :func:`twin` at its key path in ``target`` replaced by ``take(it, twin)``.

    Key paths run through dicts (by key), lists and tuples (by index) on both sides, the
    way :func:`find_bad_leaf` names them; tensors inside other objects are left as they
    are. Dicts and lists are changed in place; tuples (namedtuples too) are rebuilt.
    """
    if isinstance(saved, torch.Tensor):
        return take(saved, target) if twin(saved, target) else saved
    if isinstance(saved, dict) and isinstance(target, dict):
        for key, value in list(saved.items()):
            if key in target:
                new = graft(value, target[key], take)
                if new is not value:
                    saved[key] = new
        return saved
    if not (isinstance(saved, (list, tuple)) and isinstance(target, (list, tuple))):
        return saved
    items = [graft(a, b, take) for a, b in zip(saved, target)] + list(saved[len(target):])
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
    matches nothing: all of it is restored into fresh tensors.
    """
    unpickler = _Unpickler(io.BytesIO(meta), _meta_tensor)
    try:
        skeleton = _load(unpickler)
    except Exception:  # noqa: BLE001 - a user's __setstate__ on a meta tensor; an unsafe meta (unpack says why)
        return {}
    index = {id(t): i for i, t in unpickler._made.items()}
    found: dict[int, torch.Tensor] = {}

    def take(saved: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        found.setdefault(index[id(saved)], target)
        return saved

    graft(skeleton, into, take)
    return found


@torch.no_grad()
def copy_into(state: Any, into: Any) -> Any:
    """``state`` (already loaded), each tensor with a :func:`twin` in ``into`` copied into it and replaced by it."""
    return graft(state, into, lambda saved, target: target.copy_(saved))
