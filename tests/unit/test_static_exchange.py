"""The static nodes' one exchange (node table) over real loopback sockets, one thread per node."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous import registry, static_exchange
from elaunch.rendezvous.contract import (
    NodeInfo,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from tests.conftest import wait_for
from tests.helpers import free_port, port_open


def static_params(port, rank, nnodes, nproc, role="default", local_addr=None, **conf):
    return RendezvousParameters("static", f"127.0.0.1:{port}", "job", nnodes, nnodes,
                                config={"rank": str(rank), **{k: str(v) for k, v in conf.items()}},
                                local_addr=local_addr, role=role, local_world_size=nproc)


def host(port, nproc, nnodes, timeout=30.0, role="default"):
    return static_exchange.gather(static_exchange.listen(port), NodeInfo("127.0.0.1", role, nproc), nnodes, timeout)


def join(port, rank, nproc, nnodes, timeout=30.0, role="default", addr=""):
    return static_exchange.join("127.0.0.1", port, NodeInfo(addr, role, nproc), rank, nnodes, timeout)


def test_every_node_gets_the_same_table_in_group_rank_order_whoever_comes_first():
    port = free_port()
    with ThreadPoolExecutor(3) as pool:
        # node ranks 2 and 1 connect before node rank 0 listens: they retry
        late = [pool.submit(join, port, 2, 3, 3, role="b", addr="node2"), pool.submit(join, port, 1, 1, 3)]
        tables = [pool.submit(host, port, 2, 3).result(timeout=60)] + [f.result(timeout=60) for f in late]
    expected = (NodeInfo("127.0.0.1", "default", 2), NodeInfo("127.0.0.1", "default", 1), NodeInfo("node2", "b", 3))
    assert tables == [expected] * 3  # node rank 1 gave no address: node rank 0 records the one it saw


def test_the_port_is_free_for_worker_rank_0_once_the_table_is_out():
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(join, port, 1, 1, 2)
        host(port, 1, 2)
        other.result(timeout=60)
    # the joining node closed first: no connection of this port lingers here, a plain bind works
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_nodes_started_with_another_nnodes_all_fail_with_the_same_line():
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        server = pool.submit(host, port, 1, 3)
        assert wait_for(lambda: port_open(port), 30, what="node rank 0 listening")
        with pytest.raises(RendezvousConfigError) as joined:
            join(port, 1, 1, 2)
        with pytest.raises(RendezvousConfigError) as hosted:
            server.result(timeout=60)
    assert str(joined.value) == str(hosted.value) == (
        "--nnodes=2 on node rank 1 (127.0.0.1) but --nnodes=3 on node rank 0: "
        "every node of a static job needs the same --nnodes")


def hello(rank, nnodes, nproc, addr):
    return json.dumps({"elaunch": 1, "rank": rank, "nnodes": nnodes, "role": "default",
                       "local_world_size": nproc, "addr": addr}).encode() + b"\n"


def test_a_node_rank_taken_twice_is_refused_and_the_first_keeps_it():
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        server = pool.submit(host, port, 1, 3)
        assert wait_for(lambda: port_open(port), 30, what="node rank 0 listening")
        with socket.create_connection(("127.0.0.1", port)) as first:
            first.sendall(hello(1, 3, 4, "first"))  # in node rank 0's buffer before the second connects
            with pytest.raises(RendezvousConfigError, match=r"^--node-rank=1 of second is already taken by first: "):
                join(port, 1, 2, 3, addr="second")
            third = pool.submit(join, port, 2, 1, 3)
            assert json.loads(first.makefile("rb").readline())["nodes"][1] == ["first", "default", 4]
        table = server.result(timeout=60)
        assert table[1] == NodeInfo("first", "default", 4) and third.result(timeout=60) == table


def test_a_node_that_leaves_before_the_others_came_frees_its_rank(caplog):
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        server = pool.submit(host, port, 1, 3)
        assert wait_for(lambda: port_open(port), 30, what="node rank 0 listening")
        with socket.create_connection(("127.0.0.1", port)) as gone:
            gone.sendall(hello(1, 3, 9, "gone"))
        with caplog.at_level("WARNING", logger="elaunch"):
            again = pool.submit(join, port, 1, 2, 3, addr="again")  # node rank 1's agent, restarted
            table = join(port, 2, 1, 3)
        assert server.result(timeout=60) == table == again.result(timeout=60)
    assert table[1] == NodeInfo("again", "default", 2)
    assert "static rendezvous: node rank 1 (gone) left before every node joined" in caplog.text


def test_a_stranger_on_the_port_is_ignored(caplog):
    port = free_port()
    with ThreadPoolExecutor(1) as pool, caplog.at_level("WARNING", logger="elaunch"):
        server = pool.submit(host, port, 1, 2)
        assert wait_for(lambda: port_open(port), 30, what="node rank 0 listening")
        with socket.create_connection(("127.0.0.1", port)) as stranger:
            stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert stranger.recv(100) == b""  # dropped without an answer
        assert join(port, 1, 1, 2) == server.result(timeout=60)
    assert "ignored a connection from 127.0.0.1: not an elaunch agent" in caplog.text


def test_waiting_ends_after_the_timeout_naming_who_is_missing():
    port = free_port()
    with pytest.raises(RendezvousTimeoutError, match=r"node rank\(s\) 1, 2 of 3 did not join within 0.2 s"):
        host(port, 1, 3, timeout=0.2)
    with pytest.raises(RendezvousTimeoutError, match=rf"node rank 0 at 127.0.0.1:{port} did not answer within 0.2 s"):
        join(port, 1, 1, 2, timeout=0.2)


def test_a_listener_that_is_not_node_rank_0_is_named():
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]

        def close_first():
            conn, _ = other.accept()
            conn.close()

        t = threading.Thread(target=close_first)
        t.start()
        with pytest.raises(RendezvousConnectionError, match="is node rank 0 an elaunch agent of this job"):
            join(port, 1, 1, 2, timeout=30)
        t.join()


def test_a_busy_port_on_node_rank_0_is_named():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousConnectionError, match=f"node rank 0 cannot listen on port {port}"):
            static_exchange.listen(port)


def test_handlers_meet_once_and_restarts_reuse_the_table():
    port = free_port()
    handlers = [registry.create_handler(static_params(port, r, 2, n, local_addr=f"n{r}")) for r, n in ((0, 1), (1, 3))]
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    nodes = (NodeInfo("n0", "default", 1), NodeInfo("n1", "default", 3))
    assert [(i.round, i.rank, i.world_size, i.nodes) for i in first] == [(0, 0, 2, nodes), (0, 1, 2, nodes)]
    assert not port_open(port)
    again = [h.next_rendezvous() for h in handlers]  # a restart: no second meeting, nothing listens
    assert [(i.round, i.nodes) for i in again] == [(1, nodes), (1, nodes)]
    assert not port_open(port)


def test_one_static_node_meets_nobody():
    h = registry.create_handler(static_params(1, 0, 1, 4))
    assert h.next_rendezvous().nodes == (NodeInfo("127.0.0.1", "default", 4),)


@pytest.mark.parametrize("port,conf,needle", [
    (0, {}, "--rdzv-endpoint=127.0.0.1:0: port 0 with --nnodes=2"),
    (1, {"timeout": "soon"}, "--rdzv-conf timeout=soon: expected seconds"),
    (1, {"timeout": "0"}, "--rdzv-conf timeout=0: must be > 0 seconds"),
])
def test_bad_static_values_are_named(port, conf, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        registry.create_handler(static_params(port, 1, 2, 1, **conf))
