"""A real CPU cap for tests: a cgroup with the ``cpu`` controller (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import wait_for

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


class CpuCap:
    """A cgroup with a CPU cap (``share`` of one CPU), v1 ``cpu`` controller or v2 ``cpu.max``; removed on close."""

    def __init__(self, share: float) -> None:
        period = 100_000
        quota = int(share * period)
        if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            self.root = CGROUP_V1
            self.path = CGROUP_V1 / f"elt-{os.getpid()}-straggler"
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text(errors="replace").split():
            self.root = CGROUP_V2
            self.path = CGROUP_V2 / f"elt-{os.getpid()}-straggler"
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            pytest.skip("no cgroup cpu controller to cap a worker with")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # the whole process, every thread

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        wait_for(lambda: not (self.path / "cgroup.procs").read_text().split(), 10, what="the cgroup to empty")
        self.path.rmdir()
