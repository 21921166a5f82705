"""The snapshot slot file: one committed snapshot of one rank, readable without torch.

A worker's snapshot lives in a file of the agent's node directory in ``/dev/shm``
(``ELAUNCH_CHECKPOINT_SHM``): two slot files per local rank (``slots/<local_rank>.0``
and ``.1``), and the copies peers sent (``replicas/``). Every one has this layout:

=========  =====================================================================
offset     what
=========  =====================================================================
0          the header, :data:`HEADER_SIZE` (64) bytes, little endian:
           ``magic`` 8s, ``seq`` Q, ``step`` q, ``rank`` i, ``world_size`` i,
           ``flags`` I, ``meta_len`` Q, ``data_len`` Q, ``crc`` I, ``time`` d
4096       ``meta_len`` bytes: the state's structure (a pickle; the worker side
           ``elaunch.checkpoint`` reads it), tensors replaced by references into the data
data_at    ``data_len`` bytes of tensor data, ``data_at = align(4096 + meta_len, 4096)``
=========  =====================================================================

**The commit is a sequence lock.** A writer first makes ``seq`` odd (writing), then
writes the meta and the data, then the header's fields and their checksum (``crc``:
CRC-32 of the header's fields from ``step`` to ``data_len``, ``time`` and the meta),
and last makes ``seq`` even again: the commit. A reader takes a snapshot only when
``seq`` is even and the same before and after it read, and the checksum holds; so a
worker killed in the middle of a copy leaves a slot that reads as empty, and its
other slot, the previous snapshot, whole. The data itself is not summed (that would
cost more than the copy): its integrity comes from the order of the writes, which a
process's death cannot undo (the file is in memory, not on a disk that can tear).

**The order holds on weakly ordered CPUs too** (aarch64: Grace Hopper, Graviton), where
another process may see a mapping's stores in another order than they were made, and
make its own loads out of order. Between the steps above, writer and readers call
:func:`fence` on the slot file: one ``flock(LOCK_SH | LOCK_NB)`` and one ``flock(LOCK_UN)``.
Linux takes the file's per-inode file-lock spinlock (``flc_lock``, fs/locks.c) in each
of these calls, so all fences on one file are totally ordered, and each is a release of
every access its caller made before it and an acquire for every access after it. The
writer: seq odd, *fence*, meta and data, header fields and checksum, *fence*, seq even.
A reader: seq, *fence*, header fields, meta and data, *fence*, seq. So a reader that saw
a commit's seq sees every store before it, and a reader that saw any store of a later
write sees that write's odd seq after. No lock is ever held (shared locks never
conflict): a fence cannot block. It costs two system calls (about a microsecond each);
a save makes two fences, a read three. This is Linux's implementation, not a POSIX
promise (POSIX lists no file-lock call among those that synchronize memory); on x86
(total store order) the order of the writes is the order other processes see anyway.
Readers that hold a descriptor pass it (``fd``); a reader of copied bytes has no
ordering to keep.

Stdlib only: the agent (no torch) reads headers to know what its node holds.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAGIC = b"ELCKPT\x00\x01"
_HEADER = struct.Struct("<8sQqiiIQQId")
HEADER_SIZE = _HEADER.size  #: bytes of the header (64)
META_AT = 4096  #: offset of the meta
ALIGN = 4096  #: the data starts on a page
_SEQ = struct.Struct("<Q")
_SEQ_AT = 8
_FIELDS = struct.Struct("<qiiIQQ")  # step .. data_len, at offset 16
#: The largest step a snapshot records (a signed 64-bit field), and ``ckpt.save``/``SnapshotWriter`` take.
MAX_STEP = 2**63 - 1
_FIELDS_AT = 16
_CRC = struct.Struct("<Id")  # crc, time at offset 56
_CRC_AT = 16 + _FIELDS.size

#: ``flags`` bit: the state is the same on every rank (DDP): any rank's snapshot serves any rank.
REPLICATED = 1
#: ``flags`` bit: one rank's part of a ``torch.distributed.checkpoint`` save (``elaunch.checkpoint.SnapshotWriter``):
#: it holds the layout of its own chunks (a JSON document, format ``elaunch.dcp/2``), so the snapshots of all saved
#: ranks of one step together restore any world size; ``ckpt.load`` refuses it (``SnapshotReader`` reads it).
RESHARDABLE = 2


def data_offset(meta_len: int) -> int:
    """The offset of the data for a meta of ``meta_len`` bytes."""
    return -(-(META_AT + meta_len) // ALIGN) * ALIGN


def file_size(meta_len: int, data_len: int) -> int:
    """Bytes a slot file needs for ``meta_len`` bytes of meta and ``data_len`` bytes of data."""
    return data_offset(meta_len) + data_len


@dataclass(frozen=True)
class SlotInfo:
    """A committed snapshot as its header tells it.

    Attributes:
        path: the file.
        seq: the commit's sequence number (even; it changes at each write).
        step: the training step the worker saved (``ckpt.save(step=...)``).
        rank: the global rank that saved it; world_size: the world size then.
        replicated: True when every rank's state is the same (any rank's serves any).
        meta_len, data_len: bytes of meta and tensor data.
        time: when it was committed (seconds since the epoch).
        reshardable: True for a rank's part of a ``torch.distributed.checkpoint`` save
            (:data:`RESHARDABLE`): with its step's other ranks' parts it serves any world size.
    """

    path: str
    seq: int
    step: int
    rank: int
    world_size: int
    replicated: bool
    meta_len: int
    data_len: int
    time: float
    reshardable: bool = False

    @property
    def data_at(self) -> int:
        """Offset of the tensor data."""
        return data_offset(self.meta_len)

    @property
    def size(self) -> int:
        """Bytes of the snapshot (header, meta and data)."""
        return file_size(self.meta_len, self.data_len)


def _crc(fields: bytes, stamp: float, meta: bytes | memoryview) -> int:
    return zlib.crc32(meta, zlib.crc32(struct.pack("<d", stamp), zlib.crc32(fields))) & 0xFFFFFFFF


def fence(fd: int) -> None:
    """Order this process's accesses to the slot file ``fd`` against other processes' (see the module's text).

    One ``flock(fd, LOCK_SH | LOCK_NB)`` and one ``flock(fd, LOCK_UN)``: never blocks (no one
    takes an exclusive lock; if someone did, the refused attempt still orders).

    Raises:
        OSError: ``fd`` is not an open descriptor (EBADF).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # an exclusive lock elsewhere: the attempt took the spinlock all the same
        pass
    fcntl.flock(fd, fcntl.LOCK_UN)


def seq_of(buf) -> int:
    """The sequence number in a slot's mapping (odd: a write is under way)."""
    return _SEQ.unpack_from(buf, _SEQ_AT)[0]


def begin(buf, fd: int | None = None) -> int:
    """Mark the slot in ``buf`` (a writable mapping of the whole file) as being written; return the new seq.

    From here until :func:`commit` the slot reads as empty. ``fd``: the file's
    descriptor, fenced after the odd seq (:func:`fence`): pass it (None only in tests).
    """
    seq = seq_of(buf) if bytes(buf[:8]) == MAGIC else 0
    seq = seq + 1 if seq % 2 == 0 else seq + 2
    buf[:8] = MAGIC
    _SEQ.pack_into(buf, _SEQ_AT, seq)
    if fd is not None:
        fence(fd)  # the odd seq before any store of the meta or data
    return seq


def commit(buf, seq: int, *, step: int, rank: int, world_size: int, replicated: bool, meta_len: int,
           data_len: int, stamp: float | None = None, fd: int | None = None, reshardable: bool = False) -> int:
    """Write the header's fields and checksum, then the even ``seq + 1``: the commit. Return it.

    The meta must be at :data:`META_AT` and the data at ``data_offset(meta_len)`` already
    (their stores done, by whichever threads made them, before this call). ``fd``: the
    file's descriptor, fenced before the even seq (:func:`fence`): pass it. ``reshardable``: sets
    :data:`RESHARDABLE`.
    """
    flags = (REPLICATED if replicated else 0) | (RESHARDABLE if reshardable else 0)
    fields = _FIELDS.pack(step, rank, world_size, flags, meta_len, data_len)
    stamp = time.time() if stamp is None else stamp
    crc = _crc(fields, stamp, buf[META_AT:META_AT + meta_len])
    buf[_FIELDS_AT:_FIELDS_AT + _FIELDS.size] = fields
    _CRC.pack_into(buf, _CRC_AT, crc, stamp)
    if fd is not None:
        fence(fd)  # meta, data, fields and checksum before the even seq
    _SEQ.pack_into(buf, _SEQ_AT, seq + 1)
    return seq + 1


def parse(buf, path: str = "", fd: int | None = None) -> SlotInfo | None:
    """The committed snapshot in ``buf`` (a mapping or bytes of at least the header and meta), else None.

    None when the magic is missing, a write is under way (odd seq), the checksum
    fails, or ``buf`` is shorter than the snapshot. Callers that go on reading the
    data confirm it with :func:`still` afterwards. ``fd``: the file's descriptor when
    ``buf`` maps it (a writer may be at work): the seq is read, :func:`fence`, the rest,
    :func:`fence`, the seq again. None for bytes already copied.
    """
    if len(buf) < HEADER_SIZE:
        return None
    first = seq_of(buf)
    if fd is not None:
        fence(fd)  # the seq before the fields, the meta and (the caller's) data
    magic, seq, step, rank, world, flags, meta_len, data_len, crc, stamp = _HEADER.unpack_from(buf, 0)
    if seq != first:
        return None
    if magic != MAGIC or seq % 2 or seq == 0 or len(buf) < file_size(meta_len, data_len):
        return None
    fields = bytes(buf[_FIELDS_AT:_FIELDS_AT + _FIELDS.size])
    if _crc(fields, stamp, buf[META_AT:META_AT + meta_len]) != crc:
        return None
    if fd is not None:
        fence(fd)  # the fields and the meta before the seq read again
    if seq_of(buf) != seq:  # a writer began while we summed
        return None
    return SlotInfo(path, seq, step, rank, world, bool(flags & REPLICATED), meta_len, data_len, stamp,
                    bool(flags & RESHARDABLE))


def still(buf, info: SlotInfo, fd: int | None = None) -> bool:
    """True when the slot in ``buf`` still holds ``info``'s commit (no write began since it was parsed).

    ``fd``: the file's descriptor, fenced first (:func:`fence`): every read of the data
    made before this call is ordered before the seq is read. Pass it for a mapping.
    """
    if fd is not None:
        fence(fd)
    return seq_of(buf) == info.seq


def still_at(fd: int, info: SlotInfo) -> bool:
    """:func:`still` for a reader that reads the file through ``fd`` (``pread``, ``sendfile``), not a mapping.

    Fences ``fd``, then reads the seq with ``pread``: the check a sender makes after
    sending a snapshot's bytes.

    Raises:
        OSError: ``fd`` cannot be read.
    """
    fence(fd)
    return seq_of(os.pread(fd, _SEQ_AT + _SEQ.size, 0)) == info.seq


def read_info(path: str) -> SlotInfo | None:
    """The committed snapshot in the file at ``path``, or None (missing, empty, being written, torn).

    Reads the header and the meta only (a mapping: no copy of the data).
    """
    got = read_meta(path, with_meta=lambda _info: False)
    return None if got is None else got[0]


def read_meta(path: str, with_meta: Callable[[SlotInfo], bool] = lambda _info: True,
              ) -> tuple[SlotInfo, bytes | None] | None:
    """``(info, meta)`` of the committed snapshot in the file at ``path``, or None (as :func:`read_info`).

    ``meta`` is a copy of the snapshot's meta taken under its sequence lock (None when
    ``with_meta(info)`` is false: nothing copied); a snapshot rewritten while it was copied is None.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            return None
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as buf:
            info = parse(buf, path, fd)
            if info is None or not with_meta(info):
                return None if info is None else (info, None)
            meta = bytes(buf[META_AT:META_AT + info.meta_len])
            return (info, meta) if still(buf, info, fd) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def newest(infos: Iterable[SlotInfo | None]) -> SlotInfo | None:
    """The snapshot with the highest step (then the latest commit), or None."""
    best = None
    for info in infos:
        if info is not None and (best is None or (info.step, info.time) > (best.step, best.time)):
            best = info
    return best


def slot_paths(node_dir: str, local_rank: int) -> tuple[str, str]:
    """The two slot files of ``local_rank`` in an agent's node directory."""
    return (os.path.join(node_dir, "slots", f"{local_rank}.0"), os.path.join(node_dir, "slots", f"{local_rank}.1"))


def slot_to_write(node_dir: str, local_rank: int) -> str:
    """The slot a new snapshot of ``local_rank`` goes to: never the one holding its newest commit."""
    a, b = slot_paths(node_dir, local_rank)
    ia, ib = read_info(a), read_info(b)
    if ia is None:
        return a
    if ib is None:
        return b
    return b if newest([ia, ib]) is ia else a


def reserve(node_dir: str, local_rank: int, size: int) -> int:
    """Make ``local_rank``'s missing slot files, each ``size`` bytes of reserved memory; return the bytes reserved.

    The agent calls this for a rank whose worker restores on a node that holds no slot of
    it yet (a replacement node, a rank moved to another node): the worker's first two
    saves would otherwise each make and fill a new file (``posix_fallocate`` of the
    whole snapshot: 0.9 s for 256 MiB on a fresh test host, against 0.05-0.1 s for a
    save into a slot that exists) while its peers wait for it at the next collective.
    A file is made only where none exists (``O_EXCL``: never one a worker made or
    writes); it reads as empty (no magic) until a save commits into it, so it changes
    no inventory and no restore plan. A file that cannot be reserved whole (a full
    ``/dev/shm``: ENOSPC) stays empty (tmpfs gives back the pages the call took; a worker
    may have opened it already, so it is not removed): the worker's save then meets the
    same condition and reports it (``SnapshotTooLarge``) as before. Never raises.

    Args:
        node_dir: the agent's node directory.
        local_rank: whose slots (``slots/<local_rank>.0`` and ``.1``).
        size: bytes per file, rounded up to a page (a snapshot's :attr:`SlotInfo.size`).
    """
    size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    done = 0
    for path in slot_paths(node_dir, local_rank):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:  # a worker's file (or no slots directory): not ours to touch
            continue
        try:
            os.posix_fallocate(fd, 0, size)
            done += size
        except OSError:  # tmpfs gives back what this call took: the file stays empty, a new one to the worker
            pass
        finally:
            os.close(fd)
    return done


def files(node_dir: str, subdirs: tuple[str, ...] = ("slots", "replicas")) -> list[str]:
    """The snapshot files under ``node_dir``'s ``subdirs``, each directory's in name order (names starting
    with ``.``, a replica being received, left out; a missing directory holds none)."""
    found = []
    for sub in subdirs:
        try:
            names = sorted(os.listdir(os.path.join(node_dir, sub)))
        except OSError:
            continue
        found += [os.path.join(node_dir, sub, name) for name in names if not name.startswith(".")]
    return found


def inventory(node_dir: str, subdirs: tuple[str, ...] = ("slots", "replicas")) -> list[SlotInfo]:
    """Every committed snapshot under ``node_dir``'s ``subdirs`` (default ``slots/`` and ``replicas/``)."""
    return [info for info in map(read_info, files(node_dir, subdirs)) if info is not None]
