"""The slot file's commit protocol (elaunch.checkpoint.slotfile): pure logic on real files."""

import mmap
import os

from elaunch.checkpoint import slotfile


def _write(path, step, meta=b"meta", data=b"x" * 100, stop_before_commit=False, rank=0):
    size = slotfile.file_size(len(meta), len(data))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))
        with mmap.mmap(fd, os.fstat(fd).st_size) as buf:
            seq = slotfile.begin(buf)
            buf[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
            at = slotfile.data_offset(len(meta))
            buf[at:at + len(data)] = data
            if not stop_before_commit:
                slotfile.commit(buf, seq, step=step, rank=rank, world_size=4, replicated=True,
                                meta_len=len(meta), data_len=len(data))
    finally:
        os.close(fd)


def test_committed_snapshot_reads_back(tmp_path):
    p = str(tmp_path / "0.0")
    _write(p, 7, rank=3)
    info = slotfile.read_info(p)
    assert (info.step, info.rank, info.world_size, info.replicated, info.data_len) == (7, 3, 4, True, 100)
    assert info.seq % 2 == 0


def test_write_cut_before_commit_reads_empty_and_other_slot_survives(tmp_path):
    (tmp_path / "slots").mkdir()
    a, b = slotfile.slot_paths(str(tmp_path), 0)
    _write(a, 1)
    assert slotfile.slot_to_write(str(tmp_path), 0) == b
    _write(b, 2)
    assert slotfile.slot_to_write(str(tmp_path), 0) == a  # never the newest
    _write(a, 3, stop_before_commit=True)  # killed mid-copy
    assert slotfile.read_info(a) is None
    assert slotfile.newest(slotfile.inventory(str(tmp_path))).step == 2
    assert slotfile.slot_to_write(str(tmp_path), 0) == a


def test_torn_meta_fails_the_checksum(tmp_path):
    p = str(tmp_path / "0.0")
    _write(p, 5)
    with open(p, "r+b") as f:
        f.seek(slotfile.META_AT)
        f.write(b"X")
    assert slotfile.read_info(p) is None


def test_a_write_begun_after_parse_is_seen(tmp_path):
    p = str(tmp_path / "0.0")
    _write(p, 5)
    fd = os.open(p, os.O_RDWR)
    with mmap.mmap(fd, os.fstat(fd).st_size) as buf:
        info = slotfile.parse(buf, p)
        assert slotfile.still(buf, info)
        slotfile.begin(buf)
        assert not slotfile.still(buf, info)
        assert slotfile.parse(buf, p) is None
    os.close(fd)


def test_missing_and_short_files_are_empty(tmp_path):
    assert slotfile.read_info(str(tmp_path / "nope")) is None
    (tmp_path / "short").write_bytes(b"ELCK")
    assert slotfile.read_info(str(tmp_path / "short")) is None
    assert slotfile.inventory(str(tmp_path / "nothing")) == []


def test_reserve_makes_only_the_missing_slot_files_whole_and_empty(tmp_path):
    """The agent reserves a restoring rank's slots: never a file that exists, pages allocated, nothing committed."""
    d = str(tmp_path)
    os.mkdir(os.path.join(d, "slots"))
    a, b = slotfile.slot_paths(d, 3)
    _write(a, 5, rank=3)
    before = open(a, "rb").read()
    page = mmap.PAGESIZE
    assert slotfile.reserve(d, 3, 3 * page + 1) == 4 * page  # one file, rounded up to a page
    assert open(a, "rb").read() == before  # the worker's own snapshot untouched
    st = os.stat(b)
    assert st.st_size == 4 * page and st.st_blocks * 512 >= 4 * page and st.st_mode & 0o777 == 0o600
    assert slotfile.read_info(b) is None  # reads as empty: no inventory sees it
    assert [i.path for i in slotfile.inventory(d)] == [a]
    assert slotfile.reserve(d, 3, 3 * page) == 0  # both exist now
    assert slotfile.reserve(d, 4, page) == 2 * page and all(os.path.getsize(p) == page for p in slotfile.slot_paths(d, 4))
    assert slotfile.reserve(str(tmp_path / "gone"), 0, page) == 0  # no slots directory: nothing, no error
