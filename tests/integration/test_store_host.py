"""The agent-side workers' store (``procs.store_host``): a real child hosting real TCPStores.

Workers that connect before the child has imported torch wait in the socket's
backlog (no connect retry), each ``serve`` replaces the previous round's store
with a fresh one (also on the same port, as static rendezvous needs), a host that
died is named at the next round, and nothing is left once the host is closed.
"""

from __future__ import annotations

import datetime

import psutil
import pytest

torch_dist = pytest.importorskip("torch.distributed")

from elaunch.procs.store_host import StoreHost  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.helpers import SCRIPTS, free_port, run  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def client(port: int):
    return torch_dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def test_each_round_gets_a_fresh_store_and_close_leaves_nothing():
    host = StoreHost()
    try:
        first = host.serve("127.0.0.1", 0)  # listening now; the child may still be importing torch
        c = client(first)
        c.set("round", "0")
        assert c.get("round") == b"0"
        same = host.serve("127.0.0.1", first)  # static: the same port, a fresh store
        assert same == first
        assert not client(same).check(["round"])
        other = host.serve("127.0.0.1", 0)  # standalone: a new free port
        assert other != first and not client(other).check(["round"])
        pid = host.pid
        assert pid is not None and psutil.Process(pid).is_running()
    finally:
        host.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    host.close()  # idempotent


def test_a_port_in_use_is_an_os_error():
    host = StoreHost()
    try:
        port = host.serve("127.0.0.1", 0)
        other = StoreHost()
        try:
            with pytest.raises(OSError):
                other.serve("127.0.0.1", port)
        finally:
            other.close()
    finally:
        host.close()


@pytest.mark.slow
def test_the_workers_store_outlives_the_first_worker_to_exit(tmp_path):
    # PyTorch's test_init_method_env_with_torchelastic: static, one node, env://. As
    # under torchrun, the store lives until every worker exited: a rank that uses it
    # after rank 0's process is gone (reaped by the agent) still gets answers
    r = run("elaunch", "--nnodes=1", "--nproc-per-node=3", "--master-addr=localhost",
            f"--master-port={free_port()}", str(SCRIPTS / "store_after_exit.py"), str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {rank: (tmp_path / f"store_{rank}.txt").read_text() for rank in (1, 2)} == {1: "ok", 2: "ok"}


def test_a_store_host_that_died_is_reported_at_the_next_round():
    host = StoreHost()
    try:
        port = host.serve("127.0.0.1", 0)
        pid = host.pid
        psutil.Process(pid).kill()
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30, what="the store host's death")
        with pytest.raises(OSError, match=rf"^store host \(pid {pid}\) was killed by SIGKILL$"):
            host.serve("127.0.0.1", port)
    finally:
        host.close()
