"""A state as a pickle of its structure plus a list of tensors: the meta of a snapshot.

The structure is pickled once, with every tensor replaced by a reference (pickle's
``persistent_id``, the way ``torch.save`` does it), so any container type a picklable
state uses comes back as it was (dict, OrderedDict, defaultdict, list, tuple,
namedtuples, a user's objects holding tensors), and a tensor that appears twice
comes back as one tensor. The tensors' bytes go elsewhere (the data of a slot);
a reference says where: its offset into the data (64-byte aligned), its byte count,
dtype, shape, original device and whether it required grad.

Imported only from inside ``elaunch.checkpoint``'s functions: it imports torch.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch

#: every tensor's bytes start on a multiple of this in the data
TENSOR_ALIGN = 64
_TAG = "elaunch.t"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of a snapshot lies in the data, and what it was.

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
        return getattr(torch, self.dtype)


@dataclass
class Packed:
    """A state taken apart: ``meta`` (bytes of the pickle), the tensors and their places."""

    meta: bytes
    tensors: list[tuple[torch.Tensor, TensorRef]] = field(default_factory=list)
    data_len: int = 0


class _Unsupported(TypeError):
    """A tensor that cannot go into a snapshot (sparse, quantized, on the meta device)."""


def _check_tensor(t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise _Unsupported(f"only dense tensors with storage can be saved, not layout={t.layout}, "
                           f"quantized={t.is_quantized}, device={t.device}")


class _Pickler(pickle.Pickler):
    def __init__(self, file, record: bool = True):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.record = record
        self.packed = Packed(b"")
        self._seen: dict[int, tuple] = {}

    def persistent_id(self, obj: Any):
        if not isinstance(obj, torch.Tensor):
            return None
        pid = self._seen.get(id(obj))
        if pid is None:
            _check_tensor(obj)
            pid = self._seen[id(obj)] = (_TAG, self._place(obj) if self.record else None)
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


def pack(state: Any) -> Packed:
    """Pickle ``state``'s structure with its tensors replaced by :class:`TensorRef`.

    Args:
        state: a nested container of tensors and picklable leaves.

    Returns:
        Packed: the meta bytes, each tensor (as given, possibly non-contiguous or on
        a GPU) with its reference, and the bytes of data they need.

    Raises:
        TypeError: a leaf cannot be pickled or a tensor cannot be saved; the message
            names the leaf's key path, e.g. ``state['optimizer']['param_groups'][0]['fn']``.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(state)
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        path, leaf, why = find_bad_leaf(state, exc)
        raise TypeError(f"elaunch.checkpoint.save: cannot save {path} (a {type(leaf).__name__}): {why}") from exc
    pickler.packed.meta = buf.getvalue()
    return pickler.packed


def _leaf_error(obj: Any) -> Exception | None:
    try:
        _Pickler(io.BytesIO(), record=False).dump(obj)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def find_bad_leaf(state: Any, exc: Exception) -> tuple[str, Any, Exception]:
    """The key path, the object and the error of the first part of ``state`` that cannot be saved.

    Walks dicts (by key), lists and tuples (by index); a leaf is anything else. When no
    leaf fails alone, the innermost container that does is named (``exc`` for the root).
    """
    def walk(obj: Any, path: str):
        if isinstance(obj, dict):
            children = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            children = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        else:
            err = _leaf_error(obj)
            return None if err is None else (path, obj, err)
        for child_path, child in children:
            found = walk(child, child_path)
            if found is not None:
                return found
        if type(obj) in (dict, list, tuple):
            return None
        err = _leaf_error(obj)  # a container type of its own (a local class, ...)
        return None if err is None else (path, obj, err)

    return walk(state, "state") or ("state", state, exc)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, make: Callable[[TensorRef], torch.Tensor], as_is: Container[int] = ()):
        super().__init__(file)
        self._make = make
        self._as_is = as_is
        self._made: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid):
        tag, ref = pid
        if tag != _TAG:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        t = self._made.get(ref.index)
        if t is None:
            t = self._make(ref)
            t = self._made[ref.index] = t if ref.index in self._as_is else _with_grad(t, ref.grad)
        return t


def _with_grad(t: torch.Tensor, grad: int) -> torch.Tensor:
    if grad & 2:
        return torch.nn.Parameter(t, requires_grad=bool(grad & 1))
    if grad & 1:
        t.requires_grad_(True)
    return t


def unpack(meta: bytes, make: Callable[[TensorRef], torch.Tensor], as_is: Container[int] = ()) -> Any:
    """The state whose structure ``meta`` holds, each tensor made by ``make(ref)``.

    Unpickles ``meta`` (trusted input: a snapshot of this job, in files only its user can read).
    A tensor whose ``ref.index`` is in ``as_is`` is put in the state as ``make`` returned it;
    the others become an ``nn.Parameter`` or require grad as the saved tensor did.
    """
    return _Unpickler(io.BytesIO(meta), make, as_is).load()


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

    The structure is unpickled once with tensors on the meta device (no data). A saved
    tensor found at several key paths takes the twin of the first. A state whose
    unpickling needs its tensors' data (a user's object reading them in ``__setstate__``)
    matches nothing: all of it is restored into fresh tensors.
    """
    unpickler = _Unpickler(io.BytesIO(meta), lambda ref: torch.empty(ref.shape, dtype=ref.torch_dtype, device="meta"))
    try:
        skeleton = unpickler.load()
    except Exception:  # noqa: BLE001 - whatever a user's __setstate__ raises on a meta tensor
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
