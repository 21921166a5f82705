"""Reading a slot file's committed snapshot back: tensors copied out, the commit checked after.

The header and meta are read through a read-only mapping of the file. Tensors bound for
the CPU are read with ``preadv`` straight into new tensors (a fresh mapping would take a
page fault per 4 KiB; ``preadv`` is about 3x faster here), whose memory is first advised
to be transparent huge pages (``MADV_HUGEPAGE``: a fault per 2 MiB instead of 4 KiB).
Tensors bound for a GPU are copied from the mapping itself once it is registered with
CUDA (``cudaHostRegister``, read-only): one DMA, no host copy; if CUDA refuses, they go
through the CPU path and then ``.to(device)``.

With ``into`` (a state of the saved structure), a saved tensor whose key path holds a
tensor of its shape and dtype there is copied into that tensor instead (``_tree.match``):
a contiguous CPU one by ``preadv`` straight into its memory (a large one in parts, on
as many threads as torch uses), a strided one from the mapping, a CUDA one from the
registered mapping. Memory that is already there costs no
page faults: this is the restore as fast as a copy.

The structure is unpickled weights-only (``_tree.unpack``): a snapshot from a peer runs
no code when loaded.

After every copy the slot's sequence number is checked again (``slotfile.still``): a
snapshot overwritten while it was read raises rather than return a mix of two steps.

Imported only from inside ``elaunch.checkpoint``'s functions: it imports torch.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import warnings
from typing import Any

import torch

from elaunch.checkpoint import _shm, _tree, slotfile

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
_PART = 4 << 20  # bytes: a read of at least two of these is split across threads
_CUDA_HOST_REGISTER_READ_ONLY = 8
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def read(path: str, map_location=None, expect_step: int | None = None, into: Any = None, *, dtensors=None):
    """The committed snapshot in the slot file ``path``, its tensors copied out: ``(SlotInfo, state)``.

    ``into``: tensors at the same key paths, of the same shapes and dtypes, are filled in
    place and put in the state (the others are new, on ``map_location``); a DTensor there
    that fits a saved one (``_tree.dtensor_fits``) has its local shard filled.
    ``dtensors``: as ``_tree.unpack``'s (None: DTensors, on meshes rebuilt; ``_tree.as_entry``:
    dicts of primitives and the local shard, for a ``torch.save`` file).

    Raises:
        CheckpointError: ``path`` holds no committed snapshot, holds another step than
            ``expect_step``, or was written to while it was read (then ``into``'s tensors
            may hold parts of two steps).
        UnsafeStateError: its structure needs a class weights-only loading does not allow
            (a ``CheckpointError`` and a ``pickle.UnpicklingError``).
        CheckpointError: it holds DTensors saved at another world size than this process's.
        CheckpointError: it holds a rank's part of a DCP save (``SnapshotWriter``; flagged
            ``slotfile.RESHARDABLE``), which ``SnapshotReader`` reads.
    """
    from elaunch.checkpoint import CheckpointError

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"cannot open the snapshot {path}: {exc.strerror}") from exc
    mm = None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        info = slotfile.parse(mm, path, fd) if mm is not None else None
        if info is None:
            raise CheckpointError(f"{path} holds no committed snapshot (empty, or a write was cut short)")
        if expect_step is not None and info.step != expect_step:
            raise CheckpointError(f"{path} holds step {info.step}, the job agreed on step {expect_step}")
        if info.reshardable:  # a JSON document and raw chunks, not _tree's pickle: only DCP's load reads it
            raise CheckpointError(f"{path} holds rank {info.rank}'s part of a torch.distributed.checkpoint save "
                                  f"(step {info.step}); load it with dcp.load(state, "
                                  "storage_reader=elaunch.checkpoint.SnapshotReader())")
        return info, _copy_out(fd, mm, info, map_location, into, dtensors)
    finally:
        os.close(fd)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a traceback still holds a view: the mapping goes with the last one
                pass


def _advise_huge(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under a large new CPU tensor (a hint: ignored when refused)."""
    nbytes = t.numel() * t.element_size()
    if nbytes >= 2 * _HUGE:
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            _libc.madvise(start, end - start, _MADV_HUGEPAGE)


def _pread(fd: int, address: int, nbytes: int, offset: int) -> None:
    """Read ``nbytes`` of the file from ``offset`` to memory at ``address``."""
    done = 0
    while done < nbytes:
        view = (ctypes.c_char * (nbytes - done)).from_address(address + done)
        n = os.preadv(fd, [view], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"the snapshot file ends {nbytes - done} bytes early")
        done += n


def _read_into(fd: int, t: torch.Tensor, offset: int, threads: _Threads | None = None) -> None:
    """Fill the contiguous CPU tensor ``t`` with the file's bytes from ``offset`` (in parts on ``threads``)."""
    nbytes = t.numel() * t.element_size()
    parts = min(threads.n if threads is not None else 1, nbytes // _PART)
    if parts < 2:
        _pread(fd, t.data_ptr(), nbytes, offset)
        return
    step = -(-nbytes // parts)
    jobs = [threads.pool().submit(_pread, fd, t.data_ptr() + at, min(step, nbytes - at), offset + at)
            for at in range(0, nbytes, step)]
    concurrent.futures.wait(jobs)  # every part done before any error is raised: none writes to t after
    for job in jobs:
        job.result()


class _Threads:
    """``torch.get_num_threads()`` threads, started on first use, for ``preadv`` in parts (it releases the GIL).

    One thread copies about 8 GB/s out of ``/dev/shm`` (2-core machine); torch's ``copy_``
    of a large tensor uses all of torch's threads, and so does a large read here.
    """

    def __init__(self) -> None:
        self.n = torch.get_num_threads()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.n, thread_name_prefix="elaunch-ckpt-read")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class _Registered:
    """The whole read-only mapping as a uint8 tensor registered with CUDA, made on first use."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.base: torch.Tensor | None = None
        self.ok: bool | None = None
        self.devices: set[torch.device] = set()

    def host(self, at: int, ref: _tree.TensorRef) -> torch.Tensor:
        """The saved tensor at ``at`` as a CPU view of the mapping (read only: copy from it)."""
        if self.base is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "the buffer is not writable": we only read it
                self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.base[at:at + ref.nbytes].view(ref.torch_dtype).view(ref.shape)

    def view(self, at: int, ref: _tree.TensorRef, device: torch.device) -> torch.Tensor | None:
        """The same view, registered with CUDA (for a copy to ``device``); None when CUDA refuses."""
        src = self.host(at, ref)
        if self.ok is None:
            self.ok = _shm._pin(self.base, _CUDA_HOST_REGISTER_READ_ONLY)
        if not self.ok:
            return None
        self.devices.add(device)
        return src

    def close(self) -> None:
        """Wait for the copies, unregister, drop the view (so the mapping can close)."""
        for device in self.devices:
            torch.cuda.synchronize(device)
        if self.ok:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
        self.base = None


@torch.no_grad()
def _fill(fd: int, gpu: _Registered, threads: _Threads, at: int, ref: _tree.TensorRef,
          t: torch.Tensor) -> torch.Tensor:
    """Copy the saved tensor at ``at`` into ``t`` (its shape and dtype, any device) in place; return ``t``."""
    if not ref.nbytes:
        return t
    if t.device.type == "cpu":
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            _read_into(fd, t, at, threads)
        else:
            t.copy_(gpu.host(at, ref))
        return t
    src = gpu.view(at, ref, t.device) if t.device.type == "cuda" else None
    if src is not None:
        return t.copy_(src, non_blocking=True)  # one DMA, awaited by gpu.close() before the seqlock check
    src = torch.empty(ref.shape, dtype=ref.torch_dtype)  # CUDA refused the registration, or another device
    _read_into(fd, src, at)
    return t.copy_(src)


def _copy_out(fd: int, mm: mmap.mmap, info: slotfile.SlotInfo, map_location, into: Any = None,
              dtensors=None) -> Any:
    from elaunch.checkpoint import CheckpointError

    meta = bytes(mm[slotfile.META_AT:slotfile.META_AT + info.meta_len])
    gpu, threads = _Registered(mm), _Threads()
    matched = _tree.match(meta, into) if into is not None else {}

    def make(ref: _tree.TensorRef) -> torch.Tensor:
        if ref.index in matched:  # a DTensor's local shard is filled, the DTensor itself returned
            target = matched[ref.index]
            _fill(fd, gpu, threads, info.data_at + ref.offset, ref, _tree.local_of(target))
            return target
        if _is_function(map_location):
            t = torch.empty(ref.shape, dtype=ref.torch_dtype)
            _read_into(fd, t, info.data_at + ref.offset)
            return relocate(t, ref.device, map_location)
        device = target_device(ref.device, map_location)
        if device.type == "cuda" and ref.nbytes:
            src = gpu.view(info.data_at + ref.offset, ref, device)
            if src is not None:
                return src.to(device, non_blocking=True)
        t = torch.empty(ref.shape, dtype=ref.torch_dtype)
        _advise_huge(t)
        _read_into(fd, t, info.data_at + ref.offset)
        return t if device.type == "cpu" else t.to(device)

    try:
        state = _tree.unpack(meta, make, as_is=matched, data_len=info.data_len,
                             source=f"the snapshot {info.path} (step {info.step}, rank {info.rank})",
                             dtensors=dtensors)
    except Exception as exc:
        if not slotfile.still(mm, info, fd):
            raise CheckpointError(f"{info.path} was written to while it was read (step {info.step})") from exc
        raise
    finally:
        gpu.close()
        threads.close()
    if not slotfile.still(mm, info, fd):  # fenced: every copy above is ordered before this read of seq
        raise CheckpointError(f"{info.path} was written to while it was read (step {info.step})")
    return state


def _is_function(map_location) -> bool:
    return callable(map_location) and not isinstance(map_location, (str, dict, torch.device))


def relocate(t: torch.Tensor, saved: str, map_location) -> torch.Tensor:
    """``t`` (a new, contiguous CPU tensor read from a snapshot) where the function ``map_location`` puts it.

    As ``torch.load`` calls it: ``map_location(storage, location)`` with ``t``'s CPU
    storage and ``saved``, the device the tensor was saved on (``"cpu"``, ``"cuda:0"``);
    it returns a storage (that one, or a copy elsewhere: ``storage.cuda(rank)``), or
    None for where it was saved.
    """
    storage = map_location(t.untyped_storage(), saved)
    if storage is None:
        device = torch.device(saved)
        return t if device.type == "cpu" else t.to(device)
    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, 0, t.shape, t.stride())


def target_device(saved: str, map_location) -> torch.device:
    """Where a tensor saved on ``saved`` goes, under ``map_location`` as ``torch.load`` reads it.

    ``map_location``: None (where it was), a device string or ``torch.device``, or a
    dict from saved device strings to device strings. (A function, ``torch.load``'s
    ``map_location(storage, location)``, is applied by :func:`relocate` instead.)

    Raises:
        TypeError: ``map_location`` is of another kind.
    """
    if map_location is None:
        return torch.device(saved)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(saved, saved))
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(f"map_location must be None, a device, a device string, a dict or a function, "
                    f"not {map_location!r}")
