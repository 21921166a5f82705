"""``--node-check`` with real agents (issue 26): the check runs between the rendezvous and the workers.

Two ``elaunch`` agents on loopback meet (c10d, whose store node A's agent hosts, and
etcd-v3, where node 0's check child hosts the check's store itself); each starts its
check child as it joins, the children time the compute probe and a gloo all-reduce
between the two nodes over the round's workers' store, the agents exchange the results
through the job channel and record the same verdicts: the ``node_check`` event comes
before ``workers_started`` in both event logs, and names no node; ``elaunch status``
shows each node's verdict (CHECK) and the check's line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import finish_agents, kill_tree, port_open, start_agent
from tests.status_job import status

pytestmark = pytest.mark.slow

#: All-reduces once over the round's store (which the check used before it, on etcd hosting it at the same
#: port), notes its rank, then waits for the test's ``release`` file (``elaunch status`` is read meanwhile).
WORKER = ("import os, sys, time\n"
          "if os.environ['WORLD_SIZE'] != '1':\n"
          "    import torch, torch.distributed as dist\n"
          "    dist.init_process_group('gloo')\n"
          "    t = torch.ones(1)\n"
          "    dist.all_reduce(t)\n"
          "    assert t.item() == 2.0\n"
          "    dist.destroy_process_group()\n"
          "open(os.path.join(sys.argv[1], 'ran-' + os.environ['RANK']), 'w').close()\n"
          "while not os.path.exists(os.path.join(sys.argv[1], 'release')):\n    time.sleep(0.05)\n")


def _events(log_dir: Path) -> list[dict]:
    [path] = list(log_dir.rglob("events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def _two_agents(backend: str, ep: str, tmp_path: Path, script: tuple[str, ...], rdzv_id: str, conf: str,
                extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Start agents a and b with ``--node-check`` (logs in ``tmp_path/a`` and ``/b``); on c10d, a hosts the store."""
    agents = []
    try:
        for who in ("a", "b"):
            agents.append(start_agent(backend, ep, *script, rdzv_id=rdzv_id, conf=conf,
                                      extra=("--node-check", *extra, f"--log-dir={tmp_path / who}")))
            if backend == "c10d" and who == "a":
                wait_for(lambda: port_open(int(ep.rsplit(":", 1)[1])), 60, what="A hosting the store")
    except BaseException:
        for a in agents:
            kill_tree(a.pid)
        raise
    return agents


@pytest.mark.parametrize("endpoint", ["c10d", "etcd-v3"], indirect=True)
def test_two_agents_check_the_nodes_before_the_workers_start(endpoint, tmp_path):
    backend, ep = endpoint
    (tmp_path / "w.py").write_text(WORKER)
    conf = "last_call_timeout=1,join_timeout=60" + ("" if backend == "c10d" else ",read_timeout=20")
    agents = _two_agents(backend, ep, tmp_path, (str(tmp_path / "w.py"), str(tmp_path)), f"nc-{tmp_path.name}",
                         conf)
    try:
        wait_for(lambda: len(list(tmp_path.glob("ran-*"))) == 2, 90, what="both workers running")
        table = status(f"--rdzv-backend={backend}", f"--rdzv-endpoint={ep}", f"--rdzv-id=nc-{tmp_path.name}")
        assert table.returncode == 0, table.stderr
        header = next(line for line in table.stdout.splitlines() if line.startswith("NODE"))
        assert "CHECK" in header.split(), table.stdout
        assert "node check (round 0): every node ok" in table.stdout
        (tmp_path / "release").touch()
    except BaseException:
        for a in agents:
            kill_tree(a.pid)
        raise
    results = finish_agents(agents, timeout=120)
    assert [r[0] for r in results] == [0, 0], results
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-0", "ran-1"]
    reports = []
    for who in ("a", "b"):
        events = _events(tmp_path / who)
        kinds = [e["kind"] for e in events]
        assert kinds.index("rendezvous_complete") < kinds.index("node_check") < kinds.index("workers_started"), kinds
        [check] = [e for e in events if e["kind"] == "node_check"]
        assert check["faulty"] == [] and check["sitting_out"] == []
        assert len(check["nodes"]) == 2 and {n["verdict"] for n in check["nodes"].values()} == {"ok"}
        assert {n["group_rank"] for n in check["nodes"].values()} == {0, 1}
        assert all(n["compute"] > 0 and n["best_pair"] > 0 for n in check["nodes"].values())
        [[pairing, a, b, t]] = check["pairs"]
        assert (pairing, a, b) == (1, 0, 1) and t > 0
        assert check["seconds"] < 60
        reports.append({k: check[k] for k in ("round", "pairs", "nodes", "pair_median", "compute_median")})
    assert reports[0] == reports[1]  # the same verdicts, figures and all, on both nodes


def test_a_restart_of_the_same_nodes_is_not_checked_again(tmp_path):
    """A worker fails once: the round that restarts the same two nodes starts its workers without a second
    check (the nodes passed it already); only the first round has a ``node_check`` event."""
    from tests.helpers import free_port

    # attempt 0: rank 1 fails after an all-reduce, so rank 0's barrier fails too (neither node succeeds alone)
    worker = ("import os, sys, torch, torch.distributed as dist\n"
              "dist.init_process_group('gloo')\n"
              "dist.all_reduce(torch.ones(1))\n"
              "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
              "    os._exit(1)\n"
              "dist.barrier()\n"
              "dist.destroy_process_group()\n")
    (tmp_path / "w.py").write_text(worker)
    agents = _two_agents("c10d", f"127.0.0.1:{free_port()}", tmp_path, (str(tmp_path / "w.py"),),
                         f"nr-{tmp_path.name}", "last_call_timeout=1,join_timeout=60", ("--max-restarts=1",))
    results = finish_agents(agents, timeout=180)
    assert [r[0] for r in results] == [0, 0], results
    for who in ("a", "b"):
        events = _events(tmp_path / who)
        kinds = [e["kind"] for e in events]
        assert kinds.count("workers_started") == 2, kinds
        checks = [e for e in events if e["kind"] == "node_check"]
        assert [c["round"] for c in checks] == [0], checks
        assert kinds.index("node_check") < kinds.index("workers_started")


def test_a_single_node_job_is_not_checked(tmp_path):
    (tmp_path / "w.py").write_text(WORKER)
    (tmp_path / "release").touch()
    res = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", "--node-check",
                          f"--log-dir={tmp_path / 'l'}",
                          str(tmp_path / "w.py"), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "node_check" not in {e["kind"] for e in _events(tmp_path / "l")}


def test_a_check_that_fails_names_its_node_failed_and_leaves_no_child(tmp_path):
    """A real check child whose store cannot be reached (nothing listens): its node is ``failed``, named alike."""
    import psutil

    from elaunch.agent.events import EventLog
    from elaunch.agent.node_check import NodeCheck
    from elaunch.rendezvous.contract import NodeInfo, RendezvousInfo
    from elaunch.rendezvous.job_channel import InMemoryJobChannel
    from tests.helpers import free_port

    channel = InMemoryJobChannel("n0")
    channel.peer_docs["node_check"] = {"n1": {"group_rank": 1, "compute": 0.05, "pairs": [[1, 0, 1, None]],
                                              "error": None, "seconds": 3.0}}
    events = EventLog(None, "n0", "h")
    seen: list[dict] = []
    events.add_observer(seen.append)
    check = NodeCheck(2.0, True, 1, lambda: channel, events, budget=3.0, grace=2.0)
    check.prepare()
    pid = check._child.pid
    info = RendezvousInfo(round=4, rank=0, world_size=2, master_addr="127.0.0.1", master_port=free_port(),
                          use_agent_store=True, nodes=(NodeInfo("127.0.0.1"), NodeInfo("127.0.0.1")))
    try:
        report, out = check.run(info)
    finally:
        check.close()
    assert report.nodes["n0"].verdict == "failed" and report.nodes["n1"].verdict == "ok"
    assert report.nodes["n0"].reasons[0].startswith("check failed: "), report.nodes["n0"].reasons
    assert out == ["n0"]  # exclusion on, and n1 alone still makes MIN (1)
    [event] = [e for e in seen if e["kind"] == "node_check"]
    assert event["round"] == 4 and event["faulty"] == ["n0"] and event["sitting_out"] == ["n0"]
    assert channel.records["node_check"]["verdict"] == "failed"
    assert channel.exchanged[0][2]["group_rank"] == 0 and channel.exchanged[0][2]["error"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_check_child_that_dies_names_its_node_failed(tmp_path):
    """The check child exits before it reports (here: it crashes at once): its node is ``failed``, only named."""
    from elaunch.agent.events import EventLog
    from elaunch.agent.node_check import NodeCheck
    from elaunch.rendezvous.contract import NodeInfo, RendezvousInfo
    from elaunch.rendezvous.job_channel import InMemoryJobChannel

    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.exit(7)\n")
    channel = InMemoryJobChannel("n0")
    channel.peer_docs["node_check"] = {"n1": {"group_rank": 1, "compute": 0.05, "pairs": [], "error": None}}
    check = NodeCheck(2.0, False, 1, lambda: channel, EventLog(None, "n0", "h"), script=str(crash))
    check.prepare()
    info = RendezvousInfo(round=1, rank=0, world_size=2, master_addr="127.0.0.1", master_port=1,
                          use_agent_store=True, nodes=(NodeInfo("127.0.0.1"), NodeInfo("127.0.0.1")))
    try:
        report, out = check.run(info)
    finally:
        check.close()
    assert report.nodes["n0"].verdict == "failed" and out == []  # exclusion off: only named
    assert report.nodes["n0"].reasons[0].startswith("check failed: "), report.nodes["n0"].reasons
