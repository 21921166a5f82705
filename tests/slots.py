"""Slot files and replica services for tests: written and run as elaunch's own parts do.

:func:`write_slot` lays a snapshot out in a slot file as a worker's save does (the layout
of ``elaunch.checkpoint.slotfile``'s docstring), or leaves its write under way; the
``shm`` and ``node`` fixtures give a scratch directory in /dev/shm and real replica
services on loopback (import them into a test module to use them).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

import pytest

from elaunch.checkpoint import slotfile

#: The key every replica service of the tests holds (a job's nodes share one with ELAUNCH_JOB_SECRET).
KEY = b"k" * 32


def write_slot(path: str, step: int, data: bytes = b"x" * 64, *, meta: bytes | None = None, rank: int = 0,
               world_size: int = 8, replicated: bool = False, commit: bool = True) -> None:
    """Write a snapshot of ``rank`` at ``step`` into the slot file ``path`` (made, or resized to fit).

    Args:
        meta: the structure's bytes (default: a text naming the rank and step: not a pickle).
        commit: False: begin the write and leave it under way (odd seq).
    """
    meta = f"meta of rank {rank} step {step}".encode() if meta is None else meta
    size = slotfile.file_size(len(meta), len(data))
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as buf:
            seq = slotfile.begin(buf)
            buf[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
            at = slotfile.data_offset(len(meta))
            buf[at:at + len(data)] = data
            if commit:
                slotfile.commit(buf, seq, step=step, rank=rank, world_size=world_size, replicated=replicated,
                                meta_len=len(meta), data_len=len(data))
    finally:
        os.close(fd)


@pytest.fixture
def shm():
    """A scratch directory in /dev/shm, removed after the test."""
    path = tempfile.mkdtemp(prefix="elaunch-test-replicas-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(shm):
    """``node(name) -> (node_dir, ReplicaService)`` on 127.0.0.1 holding :data:`KEY`; all closed after the test."""
    from elaunch.checkpoint.replicas import ReplicaService

    services = []

    def make(name: str):
        node_dir = os.path.join(shm, name)
        os.makedirs(os.path.join(node_dir, "slots"), mode=0o700)
        service = ReplicaService(node_dir, "127.0.0.1", key=KEY)
        services.append(service)
        service.start()
        return node_dir, service

    yield make
    for service in services:
        service.close()
