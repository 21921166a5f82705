"""A DCP checkpoint's layout as primitives: what DCP's ``Metadata`` says less where each chunk is stored.

A layout is JSON-able (``{"fqns": {fqn: ["bytes"] or ["tensor", properties, global size, [[offsets, sizes],
...]]}, "planner_data": {fqn: [key, ...]}}``), so a snapshot's part and a persisted step's sidecars carry it
without pickling anything (the weights-only unpickler takes no DCP class). One rank's part holds the layout of
its own chunks; :func:`union_layouts` puts parts' layouts together, :func:`gaps` finds the regions of a tensor
that no chunk covers (a rank's part missing), and :func:`decode_layout` makes DCP's ``Metadata`` of a layout
again. Used by the worker's ``SnapshotWriter``/``SnapshotReader`` (``elaunch.checkpoint.dcp``) and by the
persister, which writes a persisted step's ``.metadata`` (``elaunch.checkpoint.persisted``).

torch is imported inside the functions that need it (encoding and decoding): the union and the gaps are
stdlib only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@functools.cache
def _memory_formats() -> dict:
    """``{name: torch.memory_format}`` of the formats a layout names."""
    import torch

    return {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
            "preserve_format": torch.preserve_format}


def _properties(p) -> list:
    """A ``TensorProperties`` as primitives: ``[dtype name, requires_grad, memory format name, pin_memory]``."""
    fmt = next((name for name, f in _memory_formats().items() if f == p.memory_format), "contiguous_format")
    return [str(p.dtype).removeprefix("torch."), bool(p.requires_grad), fmt, bool(p.pin_memory)]


def encode_layout(items_by_rank: list[list], planner_data: dict) -> dict:
    """The job's layout from every rank's write items (``WriteItem``), as primitives.

    Returns:
        ``{"fqns": {fqn: ["bytes"] or ["tensor", properties, size, [[offsets, sizes], ...]]},
        "planner_data": {fqn: [key, ...]}}``; a chunk written by several ranks is listed once.
    """
    from torch.distributed.checkpoint.planner import WriteItemType

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


def decode_layout(layout: Any) -> "Metadata":
    """DCP's ``Metadata`` (``storage_data`` empty) of a layout :func:`encode_layout` made.

    Raises:
        CheckpointError: the layout is malformed.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)

    from elaunch.checkpoint import CheckpointError
    from elaunch.checkpoint._tree import _DTYPES

    formats = _memory_formats()
    try:
        md: dict[str, Any] = {}
        for fqn, entry in layout["fqns"].items():
            if entry[0] == "bytes":
                md[fqn] = BytesStorageMetadata()
                continue
            _, (dtype, grad, fmt, pin), size, chunks = entry
            props = TensorProperties(dtype=_DTYPES[dtype], layout=torch.strided, requires_grad=bool(grad),
                                     memory_format=formats[fmt], pin_memory=bool(pin))
            md[str(fqn)] = TensorStorageMetadata(props, torch.Size(size), [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        planner_data = {str(k): tuple(v) for k, v in layout.get("planner_data", {}).items()}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"a DCP snapshot's layout is malformed ({type(exc).__name__}: {exc})") from exc
    return Metadata(state_dict_metadata=md, planner_data=planner_data)


def union_layouts(layouts: list[dict]) -> dict:
    """One layout of several parts' own layouts (each the chunks one rank saved): every fqn, each chunk once.

    Args:
        layouts: layouts :func:`encode_layout` made (primitives), e.g. read from parts.

    Returns:
        A layout as :func:`encode_layout`'s, whose chunks may leave parts of a tensor
        uncovered (see :func:`gaps`) when not every rank's part is among ``layouts``.

    Raises:
        CheckpointError: two layouts disagree on an fqn (its kind, properties or global size:
            parts of different saves), or one is malformed.
    """
    from elaunch.checkpoint import CheckpointError

    fqns: dict[str, list] = {}
    seen: dict[str, set] = {}  # fqn -> its chunks so far, as tuples (a replicated chunk is in every rank's part)
    data: dict = {}
    try:
        for layout in layouts:
            data.update(layout.get("planner_data", {}))
            for fqn, entry in layout["fqns"].items():
                got = fqns.get(fqn)
                if got is None:
                    got = fqns[fqn] = list(entry[:3]) + [[]] if entry[0] == "tensor" else list(entry)
                    seen[fqn] = set()
                elif got[0] != entry[0] or got[0] == "tensor" and (got[1][0], got[2]) != (entry[1][0], list(entry[2])):
                    # (requires_grad and pinning may differ by rank; as in DCP's own metadata, the first one is kept)
                    raise CheckpointError(f"the parts of one step disagree on {fqn!r} ({got[:3]} and "
                                          f"{list(entry[:3])}): they are parts of different saves")
                if entry[0] == "tensor":
                    for offsets, sizes in entry[3]:
                        key = (tuple(offsets), tuple(sizes))
                        if key not in seen[fqn]:
                            seen[fqn].add(key)
                            got[3].append([list(offsets), list(sizes)])
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"a DCP part's layout is malformed ({type(exc).__name__}: {exc})") from exc
    return {"fqns": fqns, "planner_data": data}


def gaps(size: list[int], chunks: list) -> list[list]:
    """The boxes ``[offsets, sizes]`` of a tensor of global ``size`` that none of ``chunks`` covers.

    Args:
        size: the tensor's global size. chunks: ``[[offsets, sizes], ...]``, global coordinates.

    Returns:
        Disjoint boxes whose union is the tensor less the chunks' union; ``[]``: covered.
    """
    if any(s == 0 for s in size):
        return []
    left = [(tuple(0 for _ in size), tuple(size))]
    for offsets, sizes in chunks:
        lo_c = tuple(offsets)
        hi_c = tuple(o + s for o, s in zip(offsets, sizes))
        left = [box for lo, hi in left for box in _cut(lo, hi, lo_c, hi_c)]
        if not left:
            break
    return [[list(lo), [h - l for l, h in zip(lo, hi)]] for lo, hi in left]


def _cut(lo: tuple, hi: tuple, lo_c: tuple, hi_c: tuple) -> list[tuple]:
    """The box ``[lo, hi)`` less the box ``[lo_c, hi_c)``, as disjoint boxes (at most two per dimension)."""
    if any(max(a, c) >= min(b, d) for a, b, c, d in zip(lo, hi, lo_c, hi_c)):
        return [(lo, hi)]  # apart (a 0-d box always meets: a scalar's one chunk covers it)
    out = []
    lo, hi = list(lo), list(hi)
    for d in range(len(lo)):
        if lo[d] < lo_c[d]:
            top = hi.copy()
            top[d] = lo_c[d]
            out.append((tuple(lo), tuple(top)))
            lo[d] = lo_c[d]
        if hi[d] > hi_c[d]:
            bottom = lo.copy()
            bottom[d] = hi_c[d]
            out.append((tuple(bottom), tuple(hi)))
            hi[d] = hi_c[d]
    return out
