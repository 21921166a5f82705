"""The persisted checkpoint layout: plain ``torch.save`` files that torch alone loads.

Written by the agent's persister (``--checkpoint-dir``) and, without elaunch's shared
memory (torchrun, no launcher), by the worker itself::

    DIR/step_<step:012d>/rank_<rank>_of_<world_size>.pt

Each file is ``torch.save({"step": int, "rank": int, "world_size": int, "replicated": bool,
"state": <the state>})``, so ``torch.load(path)["state"]`` (weights-only, torch's default) is
all a user who leaves elaunch needs; a state holding classes of the user's own needs them
allowed there too (``torch.serialization.add_safe_globals``). A file is written as ``.rank_..pt.tmp-<pid>`` beside it, fsynced,
renamed into place (``os.replace``) and its directory fsynced: a reader sees a whole file
or none, and names starting with ``.`` (a writer killed midway) are never read.

A step is *complete* when every rank ``0 .. world_size-1`` of one world size has its
file, or, for replicated state (the same on every rank, DDP), when any file is there.
Pruning keeps the newest complete step: the previous checkpoint stays until the new one
is complete.

elaunch reads these files with ``torch.load(weights_only=True)`` only: no file runs code
when loaded. This holds for files written by earlier elaunch versions too: they are the
same ``torch.save`` payload (only the in-memory snapshots' meta format changed), so they
load under the same rules. The ``replicated`` flag of a file is read from its pickle's
opcodes (``pickletools``), without unpickling anything, so an agent can tell which steps
are complete whatever classes the state holds.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import shutil
import zipfile
from typing import Any

from elaunch.checkpoint.dcp_layout import decode_layout, gaps, union_layouts

_STEP_DIR = re.compile(r"^step_(\d{12,})$")
_RANK_FILE = re.compile(r"^rank_(\d+)_of_(\d+)\.pt$")
#: (path, mtime_ns, size) -> the file's "replicated" flag: it is read once per file
_REPLICATED: dict[tuple[str, int, int], bool] = {}


def rank_and_world(path: str) -> tuple[int, int] | None:
    """``(rank, world_size)`` named by a rank file (``rank_<r>_of_<w>.pt``), or None for another name."""
    m = _RANK_FILE.match(os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def step_dir(directory: str, step: int) -> str:
    """The directory of ``step``'s files under ``directory``."""
    return os.path.join(directory, f"step_{step:012d}")


def rank_file(directory: str, step: int, rank: int, world_size: int) -> str:
    """The path of the file of ``rank`` (of ``world_size``) at ``step``."""
    return os.path.join(step_dir(directory, step), f"rank_{rank}_of_{world_size}.pt")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank_file(directory: str, step: int, rank: int, world_size: int, replicated: bool, state: Any) -> str:
    """Write one rank's state at ``step`` atomically; return the file's path.

    Args:
        directory: the checkpoint directory (made if missing).
        step: the training step (>= 0). rank, world_size: the saving rank and its world size.
        replicated: True when the state is the same on every rank (any file serves any rank).
        state: what ``torch.save`` can write (tensors are saved where they are; the
            persister passes CPU tensors).

    Raises:
        OSError: the file system refused (full, read-only); no partial file is left
            under the final name (the temporary one is removed when possible).
    """
    import torch

    d = step_dir(directory, step)
    made = not os.path.isdir(d)
    os.makedirs(d, exist_ok=True)
    if made:
        _fsync_dir(directory)
    final = rank_file(directory, step, rank, world_size)
    payload = {"step": step, "rank": rank, "world_size": world_size, "replicated": replicated, "state": state}
    _atomic_write(final, lambda f: torch.save(payload, f))
    _fsync_dir(d)
    return final


def load_rank_file(path: str, map_location=None, *, mmap: bool = False) -> dict:
    """The dict a rank file holds (keys ``step``, ``rank``, ``world_size``, ``replicated``, ``state``).

    Uses ``torch.load(weights_only=True)``: whoever wrote the file, loading it runs no
    code; classes of the user's own must be allowed first
    (``torch.serialization.add_safe_globals``). ``map_location`` and ``mmap`` are ``torch.load``'s
    (``mmap=True``: the tensors' bytes are not read).

    Raises:
        UnsafeStateError: the file needs a class weights-only loading does not allow (the
            message names it and how to allow it).
        OSError: the file cannot be read. Exception: torch cannot load it.
    """
    import torch

    from elaunch.checkpoint import UnsafeStateError, _tree

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not a zip torch can scan: torch's message says why
            names = []
        what = f"it needs {', '.join(n.removeprefix('builtins.') for n in names)}, which" if names else "it holds what"
        raise UnsafeStateError(f"cannot load the persisted checkpoint {path}: {what} weights-only loading (as "
                               f"torch.load(weights_only=True)) does not allow: {_tree.how_to_allow(names)}. "
                               f"({str(exc).splitlines()[0] if str(exc) else exc!r})") from exc


def _flag_from_pickle(path: str) -> bool | None:
    """The payload's ``replicated`` flag, read from the opcodes of the file's ``data.pkl`` (nothing unpickled).

    The payload dict is pickled with its keys in :func:`write_rank_file`'s order, so the
    first string ``"replicated"`` followed by a bool opcode is its flag (``"state"``, the
    only key that can hold user strings, comes last). None when it is not found.
    """
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if name is None:
            return None
        with z.open(name) as f:
            previous = None
            for op, arg, _ in pickletools.genops(f):
                if previous == "replicated" and op.name in ("NEWTRUE", "NEWFALSE"):
                    return op.name == "NEWTRUE"
                if previous == "state" or op.name == "STOP":
                    return None
                previous = arg if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE") else (
                    previous if op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE") else None)
    return None


def _is_replicated(path: str) -> bool:
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _REPLICATED:
        flag = _flag_from_pickle(path)
        if flag is None:  # another payload layout: torch alone, weights-only, reads it
            flag = bool(load_rank_file(path, map_location="cpu", mmap=True)["replicated"])  # no tensor bytes read
        _REPLICATED[key] = flag
    return _REPLICATED[key]


def steps(directory: str) -> dict[int, dict[int, dict[int, str]]]:
    """The rank files under ``directory``: ``{step: {world_size: {rank: path}}}`` (temporary files left out)."""
    found: dict[int, dict[int, dict[int, str]]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for name in names:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        try:
            files = os.listdir(os.path.join(directory, name))
        except OSError:  # pruned meanwhile
            continue
        for fname in files:
            named = rank_and_world(fname)
            if named:
                by_world = found.setdefault(int(m.group(1)), {}).setdefault(named[1], {})
                by_world[named[0]] = os.path.join(directory, name, fname)
    return found


def newest_complete(directory: str, at_most: int | None = None) -> tuple[int, dict[int, str], bool] | None:
    """The newest complete step under ``directory`` (no newer than ``at_most`` when given).

    Returns:
        ``(step, {rank: path}, replicated)``, or None when no step is complete. For a
        step written by several world sizes, a complete one of the largest is taken.
    """
    for step, by_world in sorted(steps(directory).items(), reverse=True):
        if at_most is not None and step > at_most:
            continue
        for world, files in sorted(by_world.items(), reverse=True):
            try:
                replicated = _is_replicated(next(iter(files.values())))
            except (OSError, RuntimeError, KeyError, EOFError, zipfile.BadZipFile, ValueError, pickle.PickleError):
                continue  # pruned meanwhile, or not ours
            if replicated or set(range(world)) <= set(files):
                return step, dict(files), replicated
    return None


def prune(directory: str, keep_from_step: int) -> list[int]:
    """Remove every step directory older than ``keep_from_step``; return the steps removed.

    Call it with the newest complete step once a new step is complete, so the previous
    checkpoint stays until then. Directories another pruner removed first are skipped.
    """
    removed = []
    for step in sorted(steps_on_disk(directory)):
        if step < keep_from_step:
            shutil.rmtree(step_dir(directory, step), ignore_errors=True)
            removed.append(step)
    return removed


def steps_on_disk(directory: str) -> list[int]:
    """Every step that has a directory under ``directory`` (complete or not)."""
    try:
        return [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(directory)) if m]
    except FileNotFoundError:
        return []


# -- the persisted DCP directory (``torch.distributed.checkpoint`` saves through ``SnapshotWriter``) ---------------
#
#     DIR/dcp/step_<step:012d>/                    (:func:`persisted_dir`)
#         __<rank>_0.distcp                        one per saved rank, as DCP's FileSystemWriter writes it
#         .metadata                                DCP's Metadata (pickle), written last: the step is complete
#         .__<rank>_0.index.json                   sidecar: where each of the rank's items lies in its file, and
#                                                  the layout of the rank's own chunks (its snapshot's)
#
# Each node's persister writes its own ranks' files and sidecars; whichever persister finds the
# sidecars of every rank ``0 .. world_size-1`` (one world size) writes ``.metadata``: the union of
# their layouts, once it covers every tensor whole. A chunk another sidecar of the step already
# holds (a replicated tensor, saved by every rank), or that DCP's plan gave another rank, is not
# written again, and ``.metadata`` points each chunk at the lowest rank's file holding it.

_DCP_SIDECAR = re.compile(r"^\.__(\d+)_0\.index\.json$")
#: The ``format`` of a sidecar. 2: the rank's own layout inline (1: a digest of the job's layout, in a file beside).
DCP_INDEX_FORMAT = "elaunch.dcp-index/2"
DCP_METADATA = ".metadata"


def dcp_data_name(rank: int) -> str:
    """The name of ``rank``'s data file in a DCP step directory (FileSystemWriter's, one file per rank)."""
    return f"__{rank}_0.distcp"


def dcp_sidecar_name(rank: int) -> str:
    """The name of ``rank``'s sidecar (its items' places in its data file) in a DCP step directory."""
    return f".__{rank}_0.index.json"


def layout_digest(layout: Any) -> str:
    """A digest of a DCP layout (primitives): the persisted step's ``save_id``."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _atomic_write(path: str, write) -> None:
    """``write(f)`` into ``.NAME.tmp-<pid>`` beside ``path``, fsync, rename onto ``path`` (nothing torn is left)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _make_dirs(path: str) -> None:
    """``os.makedirs`` with each directory made fsynced into its parent."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        _make_dirs(parent)
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        _fsync_dir(parent)


def read_sidecars(step_dir_path: str) -> dict[int, dict]:
    """The sidecars in a DCP step directory, by rank (unreadable or foreign ones left out)."""
    import json

    found: dict[int, dict] = {}
    try:
        names = os.listdir(step_dir_path)
    except OSError:
        return found
    for name in names:
        m = _DCP_SIDECAR.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(step_dir_path, name), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if (isinstance(doc, dict) and doc.get("format") == DCP_INDEX_FORMAT and doc.get("rank") == int(m.group(1))
                and isinstance(doc.get("layout"), dict)):
            found[int(m.group(1))] = doc
    return found


def _key(fqn: str, offsets) -> tuple:
    return (fqn, None if offsets is None else tuple(offsets))


def held_keys(sidecars: dict[int, dict], world_size: int) -> set[tuple]:
    """The ``(fqn, offsets or None)`` of every item the sidecars of one save (its world size) hold."""
    return {_key(fqn, offs) for doc in sidecars.values() if doc.get("world_size") == world_size
            for fqn, offs, _at, _len in doc.get("items", ())}


def whole_save(sidecars: dict[int, dict]) -> tuple[int, dict[int, dict]] | None:
    """``(world_size, {rank: sidecar})`` of a save every rank ``0 .. world_size-1`` has a sidecar of.

    Sidecars of another world size (a step saved again after a restart) are left aside; when
    two saves are whole, the one with the newer commits is taken.
    """
    groups: dict[int, dict[int, dict]] = {}
    for rank, doc in sidecars.items():
        world = doc.get("world_size")
        if isinstance(world, int) and 0 <= rank < world:
            groups.setdefault(world, {})[rank] = doc
    whole = [(min(float(d.get("time", 0)) for d in docs.values()), world, docs) for world, docs in groups.items()
             if len(docs) == world]
    if not whole:
        return None
    _t, world, docs = max(whole, key=lambda w: w[0])
    return world, docs


def dcp_layout(sidecars: dict[int, dict]) -> dict:
    """The layout of a whole save: the union of its sidecars' layouts (each a rank's own chunks).

    Raises:
        ValueError: it leaves a region of a tensor uncovered (named), or the layouts disagree or are malformed.
    """
    from elaunch.checkpoint import CheckpointError

    try:
        layout = union_layouts([sidecars[r]["layout"] for r in sorted(sidecars)])
        holes = [f"{fqn} at {box[0]} (size {box[1]})" for fqn, e in layout["fqns"].items() if e[0] == "tensor"
                 for box in gaps(e[2], e[3])]
    except (CheckpointError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"the sidecars' layouts do not make one: {exc}") from exc
    if holes:
        raise ValueError(f"{len(holes)} region(s) of the layout are in no rank's part ({', '.join(holes[:5])}"
                         f"{', ...' if len(holes) > 5 else ''})")
    return layout


def dcp_storage(layout: dict, sidecars: dict[int, dict]) -> dict[tuple, tuple[str, int, int]]:
    """Where each chunk of ``layout`` lies: ``{(fqn, offsets or None): (file name, offset, length)}``.

    The lowest rank's file holding a chunk is taken.

    Raises:
        ValueError: a chunk of the layout is in no sidecar (named), or the layout is malformed.
    """
    where: dict[tuple, tuple[str, int, int]] = {}
    for rank in sorted(sidecars, reverse=True):  # the lowest rank's last: it wins
        doc = sidecars[rank]
        for fqn, offs, at, length in doc["items"]:
            where[_key(fqn, offs)] = (doc["file"], int(at), int(length))
    storage, missing = {}, []
    for fqn, entry in layout["fqns"].items():
        keys = [(fqn, None)] if entry[0] == "bytes" else [(fqn, tuple(offs)) for offs, _sizes in entry[3]]
        for key in keys:
            if key in where:
                storage[key] = where[key]
            else:
                missing.append(f"{fqn} at {list(key[1]) if key[1] is not None else 'bytes'}")
    if missing:
        raise ValueError(f"{len(missing)} chunk(s) of the layout are in no rank's file ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''})")
    return storage


def write_dcp_part(directory: str, step: int, rank: int, world_size: int, layout: dict, items: list,
                   skip: set[tuple] = frozenset(), time: float = 0.0) -> str:
    """Write one rank's part of a DCP save as FileSystemWriter does, then its sidecar; return the data file's path.

    Args:
        directory: the checkpoint directory (``--checkpoint-dir``); the step's directory is made.
        step, rank, world_size: the save's. layout: the layout of the rank's own chunks (its snapshot's,
            primitives), kept in its sidecar.
        items: ``[fqn, offsets or None, tensor]`` (a bytes item is a uint8 tensor, offsets None), CPU tensors.
        skip: ``(fqn, offsets or None)`` of items another rank's file of this save holds already.
        time: the snapshot's commit time (seconds since the epoch), kept in the sidecar.

    Bytes items come first, raw; then each tensor, ``torch.save``d (DCP's TORCH_SAVE format).
    The data file and the sidecar are each written to a temporary name, fsynced and renamed.

    Raises:
        OSError: the file system refused; no partial file is left under a final name.
    """
    import json

    import torch

    d = persisted_dir(directory, step)
    _make_dirs(d)
    todo = [it for it in items if _key(it[0], it[1]) not in skip]
    todo.sort(key=lambda it: it[1] is not None)  # bytes first, as FileSystemWriter writes them
    index: list = []

    def write(f) -> None:
        for fqn, offsets, t in todo:
            at = f.tell()
            if offsets is None:
                f.write(t.contiguous().numpy().tobytes())
            else:
                t = t.detach().cpu()
                if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    t = t.clone()  # as DCP's loader does: torch.save writes a view's whole storage
                torch.save(t, f)
            index.append([fqn, offsets, at, f.tell() - at])

    data = os.path.join(d, dcp_data_name(rank))
    _atomic_write(data, write)
    doc = {"format": DCP_INDEX_FORMAT, "step": step, "rank": rank, "world_size": world_size, "layout": layout,
           "file": dcp_data_name(rank), "size": os.path.getsize(data), "time": time, "items": index}
    _atomic_write(os.path.join(d, dcp_sidecar_name(rank)), lambda f: f.write(json.dumps(doc).encode()))
    _fsync_dir(d)
    return data


def finish_dcp_step(directory: str, step: int) -> bool:
    """Write the step's ``.metadata`` once every saved rank's sidecar is there; True when the step is complete.

    Idempotent: two persisters doing it write the same file (each renames its own temporary).
    Nothing is written while a rank's sidecar is missing or its data file is not the size it records.

    Raises:
        OSError: the file system refused.
        ValueError: the sidecars of a whole save leave a region of a tensor or a chunk out (named).
    """
    import pickle as pickle_mod

    d = persisted_dir(directory, step)
    if os.path.exists(os.path.join(d, DCP_METADATA)):
        return True
    whole = whole_save(read_sidecars(d))
    if whole is None:
        return False
    _world, docs = whole
    for doc in docs.values():
        try:
            if os.path.getsize(os.path.join(d, doc["file"])) != doc["size"]:
                return False  # rewritten since (its new sidecar is not there yet)
        except OSError:
            return False
    metadata = dcp_metadata(dcp_layout(docs), docs)
    # protocol 2, torch.save's: torch's weights-only unpickler (elaunch's reader) takes no protocol-4 frames
    _atomic_write(os.path.join(d, DCP_METADATA), lambda f: pickle_mod.dump(metadata, f, protocol=2))
    _fsync_dir(d)
    return True


def dcp_metadata(layout: dict, sidecars: dict[int, dict]):
    """DCP's ``Metadata`` of a whole save: the layout, each chunk's ``_StorageInfo``, FileSystemWriter's version.

    Raises:
        ValueError: as :func:`dcp_storage`.
    """
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

    metadata = decode_layout(layout)
    metadata.storage_data = {MetadataIndex(fqn, offsets): filesystem._StorageInfo(name, at, length)
                             for (fqn, offsets), (name, at, length) in dcp_storage(layout, sidecars).items()}
    metadata.version = filesystem.CURRENT_DCP_VERSION
    metadata.storage_meta = StorageMeta(save_id=layout_digest(layout)[:32])
    return metadata


def persisted_dir(directory: str, step: int) -> str:
    """The DCP directory of ``step`` under a checkpoint directory: ``directory/dcp/step_<step:012d>``."""
    return os.path.join(directory, "dcp", f"step_{step:012d}")


def dcp_steps(directory: str) -> dict[int, bool]:
    """Every DCP step directory under ``directory/dcp``: ``{step: complete}`` (complete: ``.metadata`` there)."""
    root = os.path.join(directory, "dcp")
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    return {int(m.group(1)): os.path.exists(os.path.join(root, name, DCP_METADATA))
            for name in names if (m := _STEP_DIR.match(name))}


def newest_dcp(directory: str, at_most: int | None = None) -> tuple[int, str] | None:
    """The newest complete DCP step directory under ``directory`` (no newer than ``at_most`` when given).

    Returns:
        ``(step, path)`` (``path`` is ``directory/dcp/step_<step:012d>``, which ``dcp.load`` with a
        ``FileSystemReader`` reads), or None when no DCP step is complete. Stdlib only.
    """
    done = [s for s, complete in dcp_steps(directory).items() if complete and (at_most is None or s <= at_most)]
    if not done:
        return None
    step = max(done)
    return step, persisted_dir(directory, step)


def prune_dcp(directory: str, keep_from_step: int) -> list[int]:
    """Remove every DCP step directory older than ``keep_from_step``; return the steps removed.

    Call it with the newest complete step (or, when none is, the step just written), so a
    complete step goes only once a newer one is complete.
    """
    removed = []
    for step in sorted(dcp_steps(directory)):
        if step < keep_from_step:
            shutil.rmtree(persisted_dir(directory, step), ignore_errors=True)
            removed.append(step)
    return removed
