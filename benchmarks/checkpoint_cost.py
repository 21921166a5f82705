"""What a save blocks and what a restore costs: ``python -m benchmarks.checkpoint_cost``.

For a state of ``--mib`` MiB in 8 tensors (float32; ``--device cuda`` puts them on
the GPU), each way of saving, in one process, interleaved, ``--repeat`` times:

* ``raw``: a copy of every tensor into a mapping of one warm ``/dev/shm`` file
  (pages already faulted in): the floor;
* ``ckpt.save``: ``elaunch.checkpoint.save`` as a worker under elaunch runs it
  (``ELAUNCH_CHECKPOINT_SHM`` set), its two slots warm (the first two saves, which
  fault the slots' pages in, are reported apart as ``ckpt.save first``);
* ``torch.save+fsync``: ``torch.save`` to a file on the working directory's disk, then fsync;
* ``dcp.async_save``: ``torch.distributed.checkpoint.async_save``, the part that
  blocks training (the time to durable is reported beside it).

Restores: ``ckpt.load`` from the worker's own slot (``memory``: into new tensors;
``into``: into the preallocated tensors of the same state, as ``dcp.load`` does) and
from a replica that the replica service fetched from a peer over loopback TCP
(``peer``: the fetch plus the load), ``torch.load`` of the file saved above (page
cache), and ``dcp.load`` into a preallocated state. ``raw read`` copies the warm
mapping into new tensors, ``raw read into`` into preallocated ones (the floor of a
restore in place). Times are medians, in seconds; ratios are to ``raw`` (the issue's
targets: ``ckpt.save`` <= 2x raw and <= 0.5x ``dcp.async_save``'s blocking part;
``ckpt.load`` from memory <= 2x raw: ``load_vs_raw`` is ``into`` against ``raw read
into``, ``load_fresh_vs_raw`` new tensors against ``raw read``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

TENSORS = 8


def _state(mib: int, device: str):
    import torch

    n = mib * 2**20 // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g).to(device) for i in range(TENSORS)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class Raw:
    """The floor: one warm /dev/shm mapping, each tensor copied into its place."""

    def __init__(self, state: dict, shm: str) -> None:
        import torch

        self.state = state
        size = sum(t.numel() * t.element_size() for t in state.values())
        self.path = os.path.join(shm, "raw")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8)
        self.buf.fill_(0)  # fault every page in

    def save(self) -> None:
        at = 0
        for t in self.state.values():
            n = t.numel() * t.element_size()
            self.buf[at:at + n].copy_(t.reshape(-1).view(self.buf.dtype))
            at += n
        _sync(str(next(iter(self.state.values())).device))

    def load(self) -> None:
        at = 0
        for t in self.state.values():
            n = t.numel() * t.element_size()
            self.buf[at:at + n].clone()
            at += n

    def load_into(self, target: dict) -> None:
        at = 0
        for t in target.values():
            n = t.numel() * t.element_size()
            t.view(-1).view(self.buf.dtype).copy_(self.buf[at:at + n])
            at += n
        _sync(str(next(iter(target.values())).device))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _torch_save(state: dict, path: str) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def run(mib: int, device: str, repeat: int, disk_dir: str) -> dict:
    """Measure one state size; return ``{way: median seconds}`` and the ratios."""
    import torch
    import torch.distributed.checkpoint as dcp

    import elaunch.checkpoint as ckpt
    from elaunch.checkpoint import slotfile

    shm = tempfile.mkdtemp(prefix="elaunch-bench-", dir="/dev/shm")
    os.environ.update(ELAUNCH_CHECKPOINT_SHM=shm, LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    times: dict[str, list[float]] = {}
    try:
        state = _state(mib, device)
        raw = Raw(state, shm)
        disk = os.path.join(disk_dir, "state.pt")
        step = 0
        for first in range(2):
            step += 1
            times.setdefault("ckpt.save first", []).append(_timed(lambda: ckpt.save(state, step=step)))
        durable = []
        for r in range(repeat):
            times.setdefault("raw copy", []).append(_timed(raw.save))
            step += 1
            times.setdefault("ckpt.save", []).append(_timed(lambda: ckpt.save(state, step=step)))
            times.setdefault("torch.save+fsync", []).append(_timed(lambda: _torch_save(state, disk)))
            cid = os.path.join(disk_dir, f"dcp{r}")
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=cid)
            times.setdefault("dcp.async_save (blocking)", []).append(time.perf_counter() - t0)
            fut.result()
            durable.append(time.perf_counter() - t0)
        times["dcp.async_save (durable)"] = durable
        newest = slotfile.newest(slotfile.inventory(shm))
        os.environ.update(ELAUNCH_CHECKPOINT_RESTORE=newest.path, ELAUNCH_CHECKPOINT_STEP=str(newest.step))
        peer = _peer(shm, newest) if device == "cpu" else None
        target = {k: torch.zeros_like(v) for k, v in state.items()}  # preallocated, its pages touched
        for r in range(repeat):
            times.setdefault("raw read", []).append(_timed(raw.load))
            times.setdefault("raw read into", []).append(_timed(lambda: raw.load_into(target)))
            times.setdefault("ckpt.load memory", []).append(_timed(lambda: ckpt.load(map_location=device)))
            times.setdefault("ckpt.load into", []).append(_timed(lambda: ckpt.load(map_location=device, into=target)))
            if peer is not None:
                times.setdefault("ckpt.load peer", []).append(_timed(lambda: peer(r)))
            times.setdefault("torch.load", []).append(
                _timed(lambda: torch.load(disk, map_location=device, weights_only=True)))
            times.setdefault("dcp.load", []).append(
                _timed(lambda: dcp.load(target, checkpoint_id=os.path.join(disk_dir, "dcp0"))))
        if peer is not None:
            peer(None)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        for key in ("ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP"):
            os.environ.pop(key, None)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: mib / 1024 / v for k, v in med.items() if v > 0}
    return {"mib": mib, "device": device, "seconds": med, "GiB/s": gbps,
            "save_vs_raw": med["ckpt.save"] / med["raw copy"],
            "save_vs_async": med["ckpt.save"] / med["dcp.async_save (blocking)"],
            "load_vs_raw": med["ckpt.load into"] / med["raw read into"],
            "load_fresh_vs_raw": med["ckpt.load memory"] / med["raw read"]}


def _peer(shm: str, newest):
    """A replica service on loopback holding ``newest``; returns ``f(r)``: fetch it and ckpt.load it (None: stop)."""
    try:
        from elaunch.checkpoint import replicas
    except ImportError:
        return None
    import elaunch.checkpoint as ckpt

    other = tempfile.mkdtemp(prefix="elaunch-bench-peer-", dir="/dev/shm")
    os.makedirs(os.path.join(other, "replicas"), mode=0o700)
    shutil.copyfile(newest.path, os.path.join(other, "replicas", f"r{newest.rank}"))
    service = replicas.ReplicaService(other, "127.0.0.1")
    port = service.start()
    dest_dir = os.path.join(shm, "restore")
    os.makedirs(dest_dir, mode=0o700, exist_ok=True)

    def fetch_and_load(r):
        if r is None:
            service.close()
            shutil.rmtree(other, ignore_errors=True)
            return
        dest = os.path.join(dest_dir, f"r{newest.rank}-{r}")
        if not replicas.fetch("127.0.0.1", port, newest.rank, newest.step, dest, 60.0, key=service.key):
            raise RuntimeError("fetch from the replica service failed")
        os.environ["ELAUNCH_CHECKPOINT_RESTORE"] = dest
        try:
            ckpt.load()
        finally:
            os.environ["ELAUNCH_CHECKPOINT_RESTORE"] = newest.path
            os.unlink(dest)

    return fetch_and_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", default="256,1024", help="state sizes in MiB, comma-separated (default 256,1024)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per way (default 5)")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="elaunch-bench-", dir=os.getcwd()) as disk_dir:
        for mib in (int(m) for m in args.mib.split(",")):
            row = run(mib, args.device, args.repeat, disk_dir)
            rows.append(row)
            print(f"\n{mib} MiB on {args.device}: median seconds (GiB/s)")
            for k, v in row["seconds"].items():
                print(f"  {k:28s} {v:8.4f}  ({row['GiB/s'].get(k, 0):6.2f})")
            print(f"  ckpt.save / raw copy      {row['save_vs_raw']:.2f}  (target <= 2)")
            print(f"  ckpt.save / dcp.async_save {row['save_vs_async']:.2f}  (target <= 0.5)")
            print(f"  ckpt.load into / raw read into {row['load_vs_raw']:.2f}  (target <= 2)")
            print(f"  ckpt.load memory / raw read {row['load_fresh_vs_raw']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
