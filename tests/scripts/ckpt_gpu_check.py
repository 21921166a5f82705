"""GPU check and timings of ``elaunch.checkpoint`` (not a test: run by hand on a machine with CUDA).

``PYTHONPATH=. python ckpt_gpu_check.py [MIB...]``: a round trip of CUDA tensors (bf16, strided)
through a slot (the mapping registered with ``cudaHostRegister``), then per size (default 256
and 1024 MiB, 8 tensors) the blocking time of ``ckpt.save`` against the raw copies: CPU tensors
into a pre-faulted ``/dev/shm`` mapping, and CUDA tensors into pinned and pageable host memory;
and ``read_slot``/``load`` against ``torch.load`` of the same state. Prints one line per number.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import time

import torch

import elaunch.checkpoint as ckpt
from elaunch.checkpoint import _shm

MiB = 1 << 20


def timed(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def round_trip(shm: str) -> None:
    base = torch.randn(64, 48, device="cuda")
    state = {"w": torch.randn(1000, device="cuda").to(torch.bfloat16), "t": base.t(), "cpu": torch.arange(5),
             "nested": [{"x": base[::2, 1::3]}]}
    ckpt.save(state, 1)
    slot = _shm._SLOTS[os.path.join(shm, "slots", "0.0")]
    snap = ckpt.read_slot(slot.path, map_location=None)
    ok = (snap.state["w"].device.type == "cuda" and torch.equal(snap.state["w"], state["w"])
          and torch.equal(snap.state["t"], state["t"]) and torch.equal(snap.state["nested"][0]["x"], state["nested"][0]["x"])
          and snap.state["cpu"].device.type == "cpu")
    cpu = ckpt.read_slot(slot.path)
    ok = ok and cpu.state["w"].device.type == "cpu" and torch.equal(cpu.state["w"], state["w"].cpu())
    fn = ckpt.read_slot(slot.path, map_location=lambda storage, loc: storage.cuda(0))  # torch.load's idiom
    ok = ok and all(fn.state[k].device.type == "cuda" and torch.equal(fn.state[k].cpu(), state[k].cpu())
                    for k in ("w", "t", "cpu"))
    print(f"cuda round trip: {'ok' if ok else 'MISMATCH'}; slot pinned (cudaHostRegister): {slot.pinned}")


def raw_shm(state: dict, total: int) -> float:
    path = f"/dev/shm/elaunch-gpucheck-raw-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, total)
    mm = mmap.mmap(fd, total)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.fill_(0)

    def copy():
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).copy_(t)
            off += n
    try:
        return timed(copy)
    finally:
        del buf
        mm.close()
        os.close(fd)
        os.unlink(path)


def raw_host(state: dict, total: int, pinned: bool) -> float:
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)

    def copy():
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).copy_(t, non_blocking=pinned)
            off += n
        sync()
    return timed(copy)


def sizes(mib: int, device: str, shm: str) -> None:
    total = mib * MiB
    state = {f"t{i}": torch.randn(total // 4 // 8, device=device) for i in range(8)}
    steps = iter(range(10, 10**6))
    first = []
    for _ in range(2):
        t0 = time.perf_counter()
        ckpt.save(state, next(steps))
        first.append(time.perf_counter() - t0)
    save = timed(lambda: ckpt.save(state, next(steps)), reps=6)
    gbs = total / save / 1e9
    print(f"{mib} MiB {device}: ckpt.save {save * 1e3:.1f} ms ({gbs:.1f} GB/s); first save into each slot "
          f"{first[0] * 1e3:.0f}, {first[1] * 1e3:.0f} ms (make + reserve + map)")
    if device == "cpu":
        print(f"{mib} MiB cpu: raw copy into a pre-faulted /dev/shm mapping {raw_shm(state, total) * 1e3:.1f} ms")
    else:
        print(f"{mib} MiB cuda: raw D2H copy into pinned memory {raw_host(state, total, True) * 1e3:.1f} ms, "
              f"into pageable memory {raw_host(state, total, False) * 1e3:.1f} ms")
    slot = slotfile_newest(shm)
    read = timed(lambda: (ckpt.read_slot(slot, map_location=device), sync()), reps=3)
    ref = f"/dev/shm/elaunch-gpucheck-ref-{os.getpid()}.pt"
    torch.save(state, ref)
    try:
        tl = timed(lambda: (torch.load(ref, map_location=device), sync()), reps=3)
    finally:
        os.unlink(ref)
    print(f"{mib} MiB {device}: read_slot {read * 1e3:.1f} ms; torch.load from /dev/shm {tl * 1e3:.1f} ms")


def slotfile_newest(shm: str) -> str:
    from elaunch.checkpoint import slotfile

    return slotfile.newest(slotfile.inventory(shm)).path


def main() -> int:
    mibs = [int(a) for a in sys.argv[1:]] or [256, 1024]
    shm = f"/dev/shm/elaunch-gpucheck-{os.getpid()}"
    os.environ["ELAUNCH_CHECKPOINT_SHM"] = shm
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}, threads {torch.get_num_threads()}")
    os.makedirs(shm, mode=0o700)  # the agent's node directory, which a save does not make
    try:
        if torch.cuda.is_available():
            round_trip(shm)
        for mib in mibs:
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                _shm.close_all()
                shutil.rmtree(os.path.join(shm, "slots"), ignore_errors=True)
                sizes(mib, device, shm)
    finally:
        _shm.close_all()
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
