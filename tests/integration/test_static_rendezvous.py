"""Static rendezvous with a real TCPStore: worker rank 0 hosts a fresh store at the endpoint each round."""

from __future__ import annotations

import datetime
import gc
import socket

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from elaunch.rendezvous import registry  # noqa: E402
from elaunch.rendezvous.api import RendezvousParameters  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_static_nodes_agree_and_each_round_gets_a_fresh_store_at_the_endpoint():
    port = free_port()
    nodes = [registry.create_handler(RendezvousParameters("static", f"127.0.0.1:{port}", "job", 2, 2,
                                                          config={"rank": str(r)})) for r in range(2)]
    timeout = datetime.timedelta(seconds=5)
    for round_ in range(2):
        infos = [h.next_rendezvous() for h in nodes]
        assert [(i.round, i.rank, i.world_size) for i in infos] == [(round_, 0, 2), (round_, 1, 2)]
        assert {(i.master_addr, i.master_port, i.use_agent_store) for i in infos} == {("127.0.0.1", port, False)}
        # what worker rank 0 (on node rank 0) does: host the workers' store at MASTER_PORT
        server = torch_dist.TCPStore(infos[0].master_addr, infos[0].master_port, is_master=True,
                                     wait_for_workers=False, timeout=timeout)
        client = torch_dist.TCPStore(infos[1].master_addr, infos[1].master_port, is_master=False, timeout=timeout)
        assert not client.check(["from-round-0"])  # round 1 does not see round 0's keys
        client.set(f"from-round-{round_}", "x")
        assert server.get(f"from-round-{round_}") == b"x"
        del client, server  # the workers die: their store goes with them
        gc.collect()
