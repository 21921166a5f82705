"""Static rendezvous: real TCPStores, real agents, and torchrun side by side.

Node rank 0's agent hosts a fresh store at the endpoint each round (a store-host
child: the agent stays free of torch); before round 0 the agents meet once at the
same endpoint to learn each node's ``--nproc-per-node``.
"""

from __future__ import annotations

import datetime
import gc
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from elaunch.procs.store_host import StoreHost  # noqa: E402
from elaunch.rendezvous import registry  # noqa: E402
from elaunch.rendezvous.contract import RendezvousParameters  # noqa: E402
from tests.helpers import SCRIPTS, free_port, kill_tree, start  # noqa: E402

#: The worker variables torchrun sets from its rank assignment.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT")


def test_static_nodes_agree_and_each_round_gets_a_fresh_store_at_the_endpoint(request):
    port = free_port()
    nodes = [registry.create_handler(RendezvousParameters("static", f"127.0.0.1:{port}", "job", 2, 2,
                                                          config={"rank": str(r)})) for r in range(2)]
    host = StoreHost()
    request.addfinalizer(host.close)
    timeout = datetime.timedelta(seconds=5)
    for round_ in range(2):
        with ThreadPoolExecutor(2) as pool:  # round 0: the nodes meet at the endpoint first
            infos = list(pool.map(lambda h: h.next_rendezvous(), nodes))
        assert [(i.round, i.rank, i.world_size) for i in infos] == [(round_, 0, 2), (round_, 1, 2)]
        assert {(i.master_addr, i.master_port, i.use_agent_store) for i in infos} == {("127.0.0.1", port, True)}
        assert [i.host_store for i in infos] == [True, False]  # node rank 0's agent hosts it, as torch's
        # what node rank 0's agent does: host the round's store at MASTER_PORT (same port, fresh store)
        assert host.serve(infos[0].master_addr, infos[0].master_port) == port
        clients = [torch_dist.TCPStore(i.master_addr, i.master_port, is_master=False, timeout=timeout) for i in infos]
        assert not clients[1].check(["from-round-0"])  # round 1 does not see round 0's keys
        clients[1].set(f"from-round-{round_}", "x")
        assert clients[0].get(f"from-round-{round_}") == b"x"
        del clients  # the workers die; the agent replaces the store at the next round
        gc.collect()


def run_static_job(which: str, out: Path, nodes: list[tuple[int, str]], *extra: str, crash_rank: int = -1) -> int:
    """Run one agent per ``(nproc, role)`` of ``nodes`` on 127.0.0.1 (node rank = index) to success.

    Returns:
        The MASTER_PORT the job was given.
    """
    port = free_port()
    out.mkdir()
    agents = [
        start(which, f"--nnodes={len(nodes)}", f"--nproc-per-node={nproc}", f"--role={role}",
              "--rdzv-backend=static", f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
              *extra, str(SCRIPTS / "env_gloo.py"), str(out), str(crash_rank))
        for rank, (nproc, role) in enumerate(nodes)
    ]
    try:
        results = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    errs = [err for _, err in results]
    assert [a.returncode for a in agents] == [0] * len(nodes), "\n".join(e[-3000:] for e in errs)
    return port


def worker_docs(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("env_*.json"))}


def rank_env(docs: dict[str, dict]) -> dict[str, dict[str, str]]:
    return {name: {k: d["env"].get(k) for k in RANK_VARS} for name, d in docs.items()}


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
@pytest.mark.slow
@pytest.mark.parametrize("nodes", [[(1, "default"), (3, "default")], [(3, "trainer"), (1, "reader"), (2, "trainer")]],
                         ids=["nproc-1-3", "nproc-3-1-2-roles"])
def test_unequal_nproc_gives_torchruns_ranks_and_a_working_world(tmp_path, nodes):
    ports = {which: run_static_job(which, tmp_path / which, nodes) for which in ("elaunch", "torchrun")}
    ours, theirs = worker_docs(tmp_path / "elaunch"), worker_docs(tmp_path / "torchrun")
    for which, docs in (("elaunch", ours), ("torchrun", theirs)):
        assert {d["env"]["MASTER_PORT"] for d in docs.values()} == {str(ports[which])}
    world = sum(n for n, _ in nodes)
    assert sorted(ours) == sorted(theirs) == sorted(f"env_{r}_0" for r in range(world))
    assert rank_env(ours) == rank_env(theirs)
    # the world works: every rank's process group agrees with its env, all_reduce sums ranks 1..world
    for doc in ours.values():
        assert (doc["rank"], doc["world_size"]) == (int(doc["env"]["RANK"]), world)
        assert doc["sum"] == world * (world + 1) // 2


@pytest.mark.slow
def test_a_restart_with_unequal_nproc_keeps_the_ranks(tmp_path):
    # global rank 0 (node rank 0) fails after the all_reduce of attempt 0; every node restarts once
    nodes = [(1, "default"), (3, "default")]
    run_static_job("elaunch", tmp_path / "elaunch", nodes, "--max-restarts=1", crash_rank=0)
    docs = worker_docs(tmp_path / "elaunch")
    assert sorted(docs) == sorted(f"env_{r}_{a}" for r in range(4) for a in (0, 1))
    first, second = ({k[:-2]: v for k, v in rank_env(docs).items() if k.endswith(f"_{a}")} for a in (0, 1))
    for env in second.values():
        assert env.pop("TORCHELASTIC_RESTART_COUNT") == "1"
    for env in first.values():
        assert env.pop("TORCHELASTIC_RESTART_COUNT") == "0"
    assert first == second
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in second.values()] == [
        ("0", "0", "4", "1"), ("1", "0", "4", "3"), ("1", "1", "4", "3"), ("1", "2", "4", "3")]
    assert {d["sum"] for d in docs.values()} == {10}
