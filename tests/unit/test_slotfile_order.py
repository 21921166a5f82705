"""The seqlock's fences (issue 35, item 4): where writer and readers call ``slotfile.fence``, and that it never blocks.

What the fences buy (ordering on aarch64) cannot be seen on this x86 machine; what can be
checked is that each side calls them between the right accesses, on a real file: the
writer's fences see the odd seq and every field stored, the reader's fences sit between
its two reads of seq, and a fence returns at once even while another process holds an
exclusive lock on the file.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys

import pytest

from elaunch.checkpoint import slotfile
from tests.conftest import wait_for


@pytest.fixture
def slot(tmp_path):
    path = tmp_path / "0.0"
    meta = b"m" * 100
    size = slotfile.file_size(len(meta), 64)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    buf = mmap.mmap(fd, size)
    buf[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
    yield str(path), fd, buf, len(meta)
    buf.close()
    os.close(fd)


def test_the_writer_fences_after_the_odd_seq_and_before_the_even_one(slot, monkeypatch):
    path, fd, buf, meta_len = slot
    seen = []
    real = slotfile.fence
    monkeypatch.setattr(slotfile, "fence", lambda f: (seen.append((f, slotfile.seq_of(buf),
                                                                   bytes(buf[16:24]))), real(f)))
    seq = slotfile.begin(buf, fd)
    assert seen == [(fd, seq, bytes(8))] and seq % 2 == 1  # the odd seq stored before the fence
    slotfile.commit(buf, seq, step=7, rank=0, world_size=1, replicated=True, meta_len=meta_len, data_len=64, fd=fd)
    # the second fence: the fields already stored (step 7), the seq still odd; the even seq after it
    assert seen[1] == (fd, seq, (7).to_bytes(8, "little")) and slotfile.seq_of(buf) == seq + 1


def test_the_reader_fences_between_its_reads_of_seq(slot, monkeypatch):
    path, fd, buf, meta_len = slot
    seq = slotfile.begin(buf, fd)
    slotfile.commit(buf, seq, step=3, rank=0, world_size=1, replicated=True, meta_len=meta_len, data_len=64, fd=fd)
    calls = []
    real_fence, real_seq = slotfile.fence, slotfile.seq_of
    monkeypatch.setattr(slotfile, "fence", lambda f: (calls.append("fence"), real_fence(f)))
    monkeypatch.setattr(slotfile, "seq_of", lambda b: (calls.append("seq"), real_seq(b))[1])
    info = slotfile.read_info(path)
    assert info is not None and info.step == 3
    assert calls == ["seq", "fence", "fence", "seq"], calls
    calls.clear()
    assert slotfile.still_at(fd, info) and calls == ["fence", "seq"]
    slotfile.begin(buf, fd)
    assert not slotfile.still_at(fd, info)  # a write began: the sender's check refuses


def test_a_fence_never_blocks_on_another_process_holding_the_file_locked(slot):
    path, fd, buf, meta_len = slot
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({path!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = []
        import threading
        t = threading.Thread(target=lambda: (slotfile.fence(fd), done.append(True)), daemon=True)
        t.start()
        wait_for(lambda: done, timeout=5, what="the fence to return while another process holds LOCK_EX")
        with pytest.raises(BlockingIOError):  # the exclusive lock was really there
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
