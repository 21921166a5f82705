"""Saving into slot files: the in-memory mode (under elaunch). Reading them: ``_read``.

A worker keeps each slot file it wrote open and mapped between saves (one mapping per
file, remapped only when a snapshot outgrows it), so a save after the first is one copy
of the tensors into memory that is already there. When a file is made or grown its
pages are reserved (``posix_fallocate``: a full ``/dev/shm`` fails there, with ENOSPC,
not with a SIGBUS in the middle of a copy) and mapped (``MADV_POPULATE_WRITE``), so the
first save does not pay a page fault per 4 KiB either.

CUDA tensors are copied straight into the mapping after it is registered with CUDA
(``cudaHostRegister``: pinned, so the device-to-host copy is a DMA); when registration
fails the copy goes through pageable memory (slower, same result).

Imported only from inside ``elaunch.checkpoint``'s functions: it imports torch.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Any

import torch

from elaunch.checkpoint import _tree, slotfile

log = logging.getLogger(__name__)

#: ``madvise`` advice to fault a range in, writable (Linux 5.14+; missing from older ``mmap`` modules)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(base: torch.Tensor) -> bool:
    """Fault every page of the mapping ``base`` views in, writable (``MADV_POPULATE_WRITE``); False if the
    kernel cannot (older than 5.14: the first copy faults them in instead).

    Through ctypes, which lets go of the GIL: ``mmap.madvise`` holds it for the whole call
    (0.25 s for 1 GiB), and a spare's mapping thread at nice 19 then stalled the worker's
    own thread for as long as the scheduler kept it off the CPU.
    """
    return _libc.madvise(base.data_ptr(), base.numel(), MADV_POPULATE_WRITE) == 0


class _Slot:
    """One slot file, open and mapped for writing, kept across saves."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        st = os.fstat(self.fd)
        self.ino, self.size = st.st_ino, st.st_size
        self.mm: mmap.mmap | None = None
        self.base: torch.Tensor | None = None  # a uint8 view of the whole mapping
        self.pinned = False
        if self.size >= slotfile.HEADER_SIZE:
            self._map()

    def current(self) -> bool:
        """True when ``path`` still names this file (the agent did not remove or replace it)."""
        try:
            return os.stat(self.path).st_ino == self.ino
        except OSError:
            return False

    def held(self) -> int:
        """Bytes of memory the file holds now."""
        return os.fstat(self.fd).st_blocks * 512

    def grow(self, size: int) -> None:
        """Make the file ``size`` bytes, its pages allocated and mapped; raise OSError (ENOSPC) when full."""
        self._unmap()
        os.posix_fallocate(self.fd, 0, size)
        self.size = os.fstat(self.fd).st_size
        self._map()
        populate(self.base)

    def _map(self) -> None:
        self.mm = mmap.mmap(self.fd, self.size)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)

    def _unmap(self) -> None:
        if self.mm is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.pinned = False
        self.base = None
        self.mm.close()
        self.mm = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


_SLOTS: dict[str, _Slot] = {}
_LOCK = threading.Lock()


def _slot(path: str) -> _Slot:
    slot = _SLOTS.get(path)
    if slot is not None and not slot.current():
        slot.close()
        slot = None
    if slot is None:
        slot = _SLOTS[path] = _Slot(path)
    return slot


def premap(shm_dir: str, local_rank: int) -> int:
    """Map ``local_rank``'s slot files that exist and fault their pages in, writable; return how many.

    A mapping is its process's own: a restarted worker built it anew, one page fault per
    page, in its first two saves (about 0.25 s each for a 256 MiB state on 2 busy cores,
    against 0.05 s for a later save). A warm spare calls this while it waits
    (``elaunch.procs._warm_child``), so that the worker it becomes finds both slots mapped.
    A slot the agent replaced since is mapped again at the save (:meth:`_Slot.current`).
    """
    mapped = 0
    with _LOCK:
        for path in slotfile.slot_paths(shm_dir, local_rank):
            if not os.path.exists(path):
                continue
            slot = _slot(path)
            if slot.mm is None:
                continue
            populate(slot.base)
            mapped += 1
    return mapped


def close_all() -> None:
    """Unmap and close every slot file this process keeps open (their memory goes once the agent removes them)."""
    with _LOCK:
        while _SLOTS:
            _SLOTS.popitem()[1].close()


def check_space(shm_dir: str, path: str, need: int) -> None:
    """Raise ``SnapshotTooLarge`` unless ``need`` bytes fit the free memory of ``shm_dir``'s file system.

    The bytes the slot at ``path`` holds already count as free: the snapshot replaces them.
    """
    from elaunch.checkpoint import SnapshotTooLarge

    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    try:
        held = os.stat(path).st_blocks * 512
    except FileNotFoundError:
        held = 0
    if free + held < need:
        raise SnapshotTooLarge(
            errno.ENOSPC,
            f"the snapshot needs {need / _MiB:.1f} MiB of shared memory, {(free + held) / _MiB:.1f} MiB are "
            f"free in {shm_dir} (counting the {held / _MiB:.1f} MiB its slot holds); nothing was overwritten. "
            f"Make /dev/shm larger (docker: --shm-size) or save less",
        )


def save(state: Any, step: int, *, replicated: bool, shm_dir: str, local_rank: int, rank: int,
         world_size: int, reshardable: bool = False) -> str:
    """Copy ``state`` into the slot of ``local_rank`` that does not hold its newest commit; return its path.

    ``reshardable``: the state is this rank's part of a ``torch.distributed.checkpoint`` save
    (``elaunch.checkpoint.dcp``); its header says so (``slotfile.RESHARDABLE``).

    Raises:
        TypeError: a leaf cannot be saved or would not load (weights-only), or a tensor is a
            DTensor; its key path is named; nothing is written.
        SnapshotTooLarge: it does not fit the free shared memory; nothing is written.
        CheckpointError: the node directory ``shm_dir`` does not exist.
    """
    packed = _tree.pack(state, replicated)
    need = slotfile.file_size(len(packed.meta), packed.data_len)
    _make_slots_dir(shm_dir)
    with _LOCK:
        path = slotfile.slot_to_write(shm_dir, local_rank)
        check_space(shm_dir, path, need)
        slot = _slot(path)
        if slot.size < need:
            _grow(slot, shm_dir, need)
        buf = slot.mm
        seq = slotfile.begin(buf, slot.fd)
        buf[slotfile.META_AT:slotfile.META_AT + len(packed.meta)] = packed.meta
        copy_in(slot, slotfile.data_offset(len(packed.meta)), packed.tensors)
        slotfile.commit(buf, seq, step=step, rank=rank, world_size=world_size, replicated=replicated,
                        meta_len=len(packed.meta), data_len=packed.data_len, fd=slot.fd, reshardable=reshardable)
    return path


def _make_slots_dir(shm_dir: str) -> None:
    """Make ``shm_dir/slots`` (0700) if missing; never the node directory itself (the agent's to make and remove)."""
    from elaunch.checkpoint import CheckpointError

    try:
        os.mkdir(os.path.join(shm_dir, "slots"), 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError as exc:
        raise CheckpointError(f"the agent's checkpoint directory {shm_dir} (ELAUNCH_CHECKPOINT_SHM) is gone: "
                              f"the agent ended or removed it") from exc


def _grow(slot: _Slot, shm_dir: str, need: int) -> None:
    from elaunch.checkpoint import SnapshotTooLarge

    size = -(-need // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        slot.grow(size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise SnapshotTooLarge(errno.ENOSPC, f"the snapshot needs {need / _MiB:.1f} MiB of shared memory in "
                               f"{shm_dir}, which filled up while it was reserved: {exc.strerror}") from exc


@torch.no_grad()
def copy_in(slot: _Slot, data_at: int, tensors: list[tuple[torch.Tensor, _tree.TensorRef]]) -> None:
    """Copy each tensor to ``data_at + ref.offset`` in ``slot``'s mapping (strided sources copied as they are)."""
    devices = {t.device for t, _ in tensors if t.device.type == "cuda"}
    if devices and not slot.pinned:
        slot.pinned = _pin(slot.base)
    for t, ref in tensors:
        if ref.nbytes:
            dst = slot.base[data_at + ref.offset:data_at + ref.offset + ref.nbytes]
            dst.view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
    for device in devices:
        torch.cuda.synchronize(device)  # the commit must follow the copies' end


def _pin(base: torch.Tensor, flags: int = 0) -> bool:
    """Register the mapping under ``base`` with CUDA (page-locked); False when CUDA refuses.

    ``flags``: ``cudaHostRegister``'s (8, ``cudaHostRegisterReadOnly``, for a read-only mapping).
    """
    err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), flags)
    ok = int(getattr(err, "value", err)) == 0
    if not ok:
        log.warning("elaunch.checkpoint: cudaHostRegister of a %d MiB slot failed (%s): CUDA tensors are copied "
                    "through pageable memory", base.numel() // _MiB, err)
    return ok
