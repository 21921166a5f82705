"""Dynamic rendezvous handlers on real etcd servers: worlds, TLS, auth, fail-over, errors."""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaunch.rendezvous import registry
from elaunch.rendezvous.contract import RendezvousClosedError, RendezvousConfigError, RendezvousConnectionError
from elaunch.rendezvous.dynamic.state import RendezvousState
from tests.conftest import REPO, wait_for
from tests.etcd.conftest import make_params
from tests.helpers import free_port

BACKENDS = ["etcd", "etcd-v2", "etcd-v3"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_world_of_three_then_a_fresh_round(backend, etcd_v2, etcd_v3, handlers):
    ep = (etcd_v3 if backend == "etcd-v3" else etcd_v2).endpoints
    hs = [handlers.make(backend, ep, f"w3-{backend}", 3, 3) for _ in range(3)]
    infos = handlers.join(*hs)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {(i.round, i.world_size, i.master_addr, i.master_port, i.use_agent_store) for i in infos} == {
        (0, 3, "127.0.0.1", infos[0].master_port, False)}
    assert [n.role for n in infos[0].nodes] == ["trainer"] * 3 and infos[0].nodes[0].local_world_size == 2
    again = handlers.join(*hs)
    assert {i.round for i in again} == {1} and len({i.master_port for i in again}) == 1
    assert again[0].master_port != infos[0].master_port  # a fresh workers' store each round
    assert all(h.get_backend() == backend and h.get_run_id() == f"w3-{backend}" for h in hs)
    assert hs[0].num_nodes_waiting() == 0


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_late_joiner_waits_and_close_rejects_it_and_run_ids_never_merge(backend, etcd_v2, etcd_v3, handlers):
    ep = (etcd_v3 if backend == "etcd-v3" else etcd_v2).endpoints
    a = handlers.make(backend, ep, f"late-{backend}", 1, 2, last_call_timeout=0.2)
    other = handlers.make(backend, ep, f"other-{backend}", 1, 2, last_call_timeout=0.2)
    ia, io = handlers.join(a, other)
    assert (ia.world_size, io.world_size) == (1, 1)
    b = handlers.make(backend, ep, f"late-{backend}", 1, 2, last_call_timeout=0.2)
    late = handlers.submit(b.next_rendezvous)
    wait_for(lambda: a.num_nodes_waiting() > 0, 15, what="late joiner on the wait list")
    assert other.num_nodes_waiting() == 0
    assert a.job_channel().num_nodes_new() == 1 and other.job_channel().num_nodes_new() == 0
    a.set_closed()
    with pytest.raises(RendezvousClosedError):
        late.result(timeout=20)
    handlers.submit(a.exit_barrier, 0.2).result(10)


def test_v3_killed_agent_is_dropped_when_its_lease_expires(etcd_v3, handlers, tmp_path):
    """A node whose agent is SIGKILLed disappears (lease) and the survivor re-forms a world of 1."""
    conf = {"last_call_timeout": "0.3", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from elaunch.rendezvous import registry
        from tests.etcd.conftest import make_params
        h = registry.create_handler(make_params("etcd-v3", {etcd_v3.endpoints!r}, "lease-kill", 2, 2, **{conf!r}))
        info = h.next_rendezvous()
        print("joined", info.world_size, flush=True)
        import time; time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        me = handlers.make("etcd-v3", etcd_v3.endpoints, "lease-kill", 2, 2, **conf)
        (info,) = handlers.join(me)
        assert info.world_size == 2 and proc.stdout.readline().strip() == "joined 2"
        proc.kill()
        proc.wait(10)
        solo = handlers.make("etcd-v3", etcd_v3.endpoints, "lease-kill", 1, 2, **conf)
        infos = handlers.join(me, solo)
        assert {(i.round, i.world_size) for i in infos} == {(1, 2)}  # the dead node is gone, the new one in
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_tls_with_client_certificates(backend, etcd_tls, tls_files, handlers):
    t = tls_files
    h = handlers.make(backend, etcd_tls.endpoints, f"tls-{backend}", 1, 1,
                      ca_cert=t.ca, ssl_cert=t.client_cert, ssl_cert_key=t.client_key)
    (info,) = handlers.join(h)
    assert info.world_size == 1


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_tls_without_client_certificate_names_the_endpoint(backend, etcd_tls, tls_files):
    with pytest.raises(RendezvousConnectionError, match=f"etcd at {etcd_tls.endpoints}"):
        registry.create_handler(make_params(backend, etcd_tls.endpoints, "tls-bad", 1, 1,
                                            ca_cert=tls_files.ca, read_timeout=1)).next_rendezvous()


def test_v3_auth_right_and_wrong_password(etcd_auth, handlers):
    user, password = etcd_auth.auth
    h = handlers.make("etcd-v3", etcd_auth.endpoints, "auth-job", 1, 1, user=user, password=password)
    (info,) = handlers.join(h)
    assert info.world_size == 1
    for conf in ({"user": user, "password": "wrong"}, {}):
        with pytest.raises(RendezvousConfigError, match=f"etcd at {etcd_auth.endpoints}"):
            registry.create_handler(make_params("etcd-v3", etcd_auth.endpoints, "auth-job", 1, 1, **conf))


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_fail_over_to_the_next_endpoint(backend, etcd_v2, etcd_v3, handlers):
    live = (etcd_v3 if backend == "etcd-v3" else etcd_v2).endpoints
    h = handlers.make(backend, f"127.0.0.1:{free_port()},{live}", f"failover-{backend}", 1, 1)
    (info,) = handlers.join(h)
    assert info.world_size == 1


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_unreachable_etcd_is_a_connection_error_naming_it(backend):
    port = free_port()
    with pytest.raises(RendezvousConnectionError, match=f"etcd at 127.0.0.1:{port} unreachable"):
        registry.create_handler(make_params(backend, f"127.0.0.1:{port}", "gone", 1, 1,
                                            read_timeout=1)).next_rendezvous()


def test_v2_backend_on_a_v3_only_etcd_says_enable_v2(etcd_v3):
    with pytest.raises(RendezvousConfigError, match="--enable-v2"):
        registry.create_handler(make_params("etcd", etcd_v3.endpoints, "nov2", 1, 1)).next_rendezvous()


@pytest.mark.parametrize("conf,needle", [
    ({"protocol": "ftp"}, "protocol=ftp"),
    ({"ca_cert": "/nonexistent/ca.pem"}, "ca_cert=/nonexistent/ca.pem: no such file"),
    ({"user": "bob"}, "user/password"),
    ({"ttl": "0"}, "ttl=0"),
    ({"read_timeout": "soon"}, "read_timeout=soon"),
])
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd-v3"])
def test_bad_conf_names_the_value(backend, conf, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        registry.create_handler(make_params(backend, "127.0.0.1:2379", "j", 1, 1, **conf))


def test_bad_endpoint_names_the_value():
    with pytest.raises(RendezvousConfigError, match="--rdzv-endpoint=host:port9"):
        registry.create_handler(make_params("etcd-v3", "host:port9", "j", 1, 1))


def test_missing_client_names_the_extra(tmp_path):
    blocker = tmp_path / "pyetcd.py"
    blocker.write_text("raise ImportError('blocked for the test')\n")
    code = ("import sys; sys.path.insert(0, %r); sys.path.insert(1, %r)\n"
            "from elaunch.rendezvous import registry\n"
            "from elaunch.rendezvous.contract import RendezvousParameters, RendezvousConfigError\n"
            "try:\n"
            "    registry.create_handler(RendezvousParameters('etcd-v3', '127.0.0.1:1', 'j', 1, 1))\n"
            "except RendezvousConfigError as e:\n"
            "    print(e)\n") % (str(tmp_path), str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'elaunch[etcd]'" in out.stdout, out.stderr


def test_v3_crowd_joins_in_batches_with_a_bounded_number_of_calls(etcd_v3, handlers):
    # the batched join (dynamic/batching.py) on etcd-v3: one transaction to post, a watch,
    # one read; only the combiner's calls grow with the crowd
    n = 16
    # liveness at its default (dead after 15 s): on a loaded machine 3 s can pass between beats;
    # no presence ports: their upkeep (a publish, the neighbours' reads) runs in the keep-alive
    # threads after the join, and would be counted here as the join's calls when it comes first
    hs = [handlers.make("etcd-v3", etcd_v3.endpoints, "crowd", n, n, keep_alive_interval=5, presence=False)
          for _ in range(n)]
    calls = {h.node_id: 0 for h in hs}
    for h in hs:
        kv, node = h._backend.kv, h.node_id
        for name in ("call", "watch"):
            def counted(*a, _f=getattr(kv, name), _n=node, **k):
                calls[_n] += 1
                return _f(*a, **k)
            setattr(kv, name, counted)
    with ThreadPoolExecutor(max_workers=n) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), hs))
    assert {(i.round, i.world_size) for i in infos} == {(0, n)}
    assert sorted(i.rank for i in infos) == list(range(n))
    assert statistics.median(calls.values()) <= 10, calls
    state = RendezvousState.from_bytes(hs[0]._backend.kv.get(hs[0]._backend.key)[0])
    assert len(state.participants) == n


def test_v3_handler_grants_its_keys_lease_before_the_first_round(etcd_v3, handlers):
    """The lease of the run's keys (``ttl``) is granted with the handler, not by the first join's post."""
    h = handlers.make("etcd-v3", etcd_v3.endpoints, "lease-early", 1, 1)
    kv = h._stores.kv
    client = kv._client()
    grants: list[int] = []
    real_lease = client.lease

    def counted_lease(ttl, *args, **kwargs):
        grants.append(ttl)
        return real_lease(ttl, *args, **kwargs)

    client.lease = counted_lease
    info = h.next_rendezvous()
    assert info.world_size == 1
    assert grants == []
    _value, meta = client.get(h._backend.key)  # the state the round wrote is on that lease
    assert meta is not None and meta.lease_id == kv._ttl_lease[0] != 0
