"""The job channel's exchange on real backends: a TCPStore (c10d) and etcd (v2, v3) hold the documents.

Three dynamic handlers form a round and exchange documents through their job
channels (``JobChannel.exchange``, ``dynamic/exchange.py``): each gets all three.
In the next round one member publishes nothing: the two others return without it
once the timeout passed, and never take its document of the round before.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous import registry
from elaunch.rendezvous.contract import RendezvousParameters

BACKENDS = ["c10d", "etcd-v2", "etcd-v3"]
CONF = {"poll_interval": "0.05", "join_timeout": "30", "read_timeout": "10", "last_call_timeout": "0.3"}


@pytest.fixture
def make_handlers():
    """``make(backend, endpoint, n)``: n handlers of one run id (the first hosts c10d's store); all shut down after."""
    made = []

    def make(backend: str, endpoint: str, n: int):
        for i in range(n):
            conf = dict(CONF, **({"is_host": str(i == 0).lower()} if backend == "c10d" else {}))
            made.append(registry.create_handler(RendezvousParameters(
                backend, endpoint, f"exchange-{backend}", n, n, config=conf, local_addr="127.0.0.1",
                role="trainer", local_world_size=1)))
        return list(made)

    yield make
    for h in reversed(made):  # the c10d store's host last
        h.shutdown()


def _in_threads(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("endpoint", BACKENDS, indirect=True)
def test_members_exchange_then_a_silent_member_is_left_out_and_its_old_document_not_taken(endpoint, make_handlers):
    backend, ep = endpoint
    hs = make_handlers(backend, ep, 3)
    infos = _in_threads(lambda h: h.next_rendezvous(), hs)
    assert {i.round for i in infos} == {infos[0].round} and infos[0].world_size == 3
    ids = [h.job_channel().node_id for h in hs]

    def exchange(args):
        h, rnd, timeout = args
        return h.job_channel().exchange("ckpt", rnd, {"from": h.job_channel().node_id, "round": rnd}, timeout)

    first = _in_threads(exchange, [(h, infos[0].round, 20.0) for h in hs])
    assert first == [{n: {"from": n, "round": infos[0].round} for n in ids}] * 3

    again = _in_threads(lambda h: h.next_rendezvous(), hs)
    rnd = again[0].round
    assert rnd > infos[0].round and {i.round for i in again} == {rnd}
    by_id = sorted(zip(ids, hs))
    silent, talking = by_id[-1], by_id[:-1]  # the leader (lowest id) talks: its agreed list is used
    start = time.monotonic()
    second = _in_threads(exchange, [(h, rnd, 1.0) for _, h in talking])
    assert second == [{n: {"from": n, "round": rnd} for n, _ in talking}] * 2, silent[0]
    assert 1.0 <= time.monotonic() - start < 15
