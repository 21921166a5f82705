"""The node check's compute probe under a real CPU cap (issue 26): the capped node is named slow by its probe.

Three real check children (``procs/_node_check_child.py``, started as the agent starts
them) meet in a TCPStore on loopback. Once all three imported torch and wait for the
round's facts, one of them is put into a cgroup capped at a tenth of a CPU (the
``cpu`` controller: v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``); then each gets its
facts. Judged together, the capped node is ``slow`` for its compute probe, the others ok.
"""

from __future__ import annotations

import json
import os
import select
import time

import psutil
import pytest

from elaunch.agent.node_check import _CHILD
from elaunch.agent.node_verdict import OK, SLOW, judge
from elaunch.procs.helper_process import HelperProcess
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


def _idle(pid: int) -> bool:
    """True once ``pid`` used no CPU for 0.3 s (it imported torch and blocks on its channel)."""
    p = psutil.Process(pid)
    before = sum(p.cpu_times()[:2])
    time.sleep(0.3)
    return sum(p.cpu_times()[:2]) == before


def test_a_cpu_capped_node_is_named_slow_by_its_compute_probe():
    if os.geteuid() != 0:
        pytest.skip("a CPU cap needs root (a cgroup)")
    import torch.distributed as dist

    from tests.multinode.test_stragglers import CpuCap

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    children = [HelperProcess("node check", _CHILD) for _ in range(3)]
    cap = None
    try:
        for c in children:
            c.start()
        for c in children:
            wait_for(lambda: _idle(c.pid), 90, interval=0.05, what="the check child to import torch")
        cap = CpuCap(0.1)
        cap.add(children[2].pid)
        for rank, c in enumerate(children):
            c.chan.send(json.dumps({"round": 0, "rank": rank, "world_size": 3, "store": ["127.0.0.1", server.port],
                                    "addr": "127.0.0.1", "device": "cpu", "budget": 30}).encode())
        docs = {}
        for rank, c in enumerate(children):
            ready, _, _ = select.select([c.chan], [], [], 60)
            assert ready, f"no result from child {rank}"
            docs[f"n{rank}"] = json.loads(c.chan.recv(1 << 16))
    finally:
        for c in children:
            c.stop()
        if cap is not None:
            cap.close()
    assert all(d["error"] is None for d in docs.values()), docs
    report = judge(0, {f"n{r}": r for r in range(3)}, docs)
    assert {n: r.verdict for n, r in report.nodes.items()} == {"n0": OK, "n1": OK, "n2": SLOW}, report
    assert any(reason.startswith("compute ") for reason in report.nodes["n2"].reasons), report.nodes["n2"]
