"""Registry, standalone and static handlers (torch-free paths)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elaunch.rendezvous import registry
from elaunch.rendezvous.contract import NodeInfo, RendezvousClosedError, RendezvousConfigError, RendezvousParameters


def params(backend, endpoint="", min_nodes=1, max_nodes=1, **conf):
    return RendezvousParameters(backend, endpoint, "job", min_nodes, max_nodes,
                                config={k: str(v) for k, v in conf.items()}, role="r", local_world_size=3)


def test_importing_registry_and_torch_free_backends_does_not_import_torch():
    code = ("import sys, elaunch.rendezvous.registry as r, elaunch.rendezvous.static, elaunch.rendezvous.standalone, "
            "elaunch.rendezvous.dynamic.handler; "
            "r.create_handler(r.RendezvousParameters('standalone', '', 'j', 1, 1)).next_rendezvous(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_backend_names():
    assert registry.backend_names() == ("c10d", "etcd", "etcd-v2", "etcd-v3", "standalone", "static")


def test_unknown_backend_is_named_with_known_ones():
    # the built-in names a user may give, then the torchrun.handlers entry points installed
    with pytest.raises(RendezvousConfigError,
                       match=r"--rdzv-backend=zookeeper: .*known: static, c10d, etcd, etcd-v2, etcd-v3\b"):
        registry.create_handler(params("zookeeper"))


@pytest.mark.parametrize("name", ["etcd", "etcd-v2", "etcd-v3"])
def test_etcd_needs_an_endpoint(name):
    with pytest.raises(RendezvousConfigError, match="--rdzv-endpoint='': an etcd backend needs host"):
        registry.create_handler(params(name))


def test_standalone_rounds_have_the_agent_host_the_store_on_a_free_port():
    h = registry.create_handler(params("standalone"))
    a, b = h.next_rendezvous(), h.next_rendezvous()
    assert (a.round, a.rank, a.world_size, a.master_addr, a.use_agent_store) == (0, 0, 1, "127.0.0.1", True)
    assert a.host_store and a.master_port == 0  # the agent binds a fresh free port each round
    assert b.round == 1 and b.host_store and b.master_port == 0
    assert a.nodes == (NodeInfo("127.0.0.1", "r", 3),)
    assert h.get_backend() == "standalone" and h.num_nodes_waiting() == 0
    h.set_closed()
    with pytest.raises(RendezvousClosedError):
        h.next_rendezvous()


def test_static_ranks_and_endpoint():
    h = registry.create_handler(params("static", "10.1.2.3:29500", 1, 1, rank=0))
    a, b = h.next_rendezvous(), h.next_rendezvous()
    assert (a.round, a.rank, a.world_size, a.master_addr, a.master_port) == (0, 0, 1, "10.1.2.3", 29500)
    assert b.round == 1 and a.use_agent_store and a.host_store and h.num_nodes_waiting() == 0
    assert a.nodes == b.nodes == (NodeInfo("10.1.2.3", "r", 3),)  # one node meets nobody


@pytest.mark.parametrize("endpoint,conf,needle", [
    ("h:1", {}, "--node-rank"),
    ("h:1", {"rank": "x"}, "rank=x"),
    ("h:1", {"rank": "2"}, "--node-rank=2: must be in 0..1"),
    ("", {"rank": "0"}, "--master-addr"),
    ("h", {"rank": "0"}, "--rdzv-endpoint=h: no port"),
    ("h:99999", {"rank": "0"}, "port '99999'"),
])
def test_static_bad_input_names_value(endpoint, conf, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        registry.create_handler(params("static", endpoint, 2, 2, **conf))


def _settings_backend(p):
    """A backend that reads the dynamic rendezvous' keys only (real RendezvousSettings)."""
    from elaunch.rendezvous.dynamic.settings import RendezvousSettings

    RendezvousSettings.from_params(p)
    return object()


def test_unused_conf_keys_are_accepted_and_named_in_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(registry._FACTORIES, "settings-only", _settings_backend)
    with caplog.at_level("WARNING", logger="elaunch"):
        registry.create_handler(params("settings-only", join_timeout=5, timeout="5'", foo="bar"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["--rdzv-conf: the settings-only rendezvous does not use timeout, foo; ignored"]


def test_used_conf_keys_keep_strict_validation(monkeypatch):
    monkeypatch.setitem(registry._FACTORIES, "settings-only", _settings_backend)
    with pytest.raises(RendezvousConfigError, match=r"--rdzv-conf join_timeout=5': expected seconds"):
        registry.create_handler(params("settings-only", join_timeout="5'"))


def test_no_warning_when_every_key_is_used(monkeypatch, caplog):
    monkeypatch.setitem(registry._FACTORIES, "settings-only", _settings_backend)
    with caplog.at_level("WARNING", logger="elaunch"):
        registry.create_handler(params("settings-only", join_timeout=5, last_call_timeout=1))
    assert caplog.records == []


def test_c10d_ignores_timeout_as_torch_does(tmp_path, caplog):
    pytest.importorskip("torch")
    path = str(tmp_path / "store")
    with caplog.at_level("WARNING", logger="elaunch"):
        registry.create_handler(params("c10d", path, store_type="file", timeout="5'", read_timeout=7))
    assert [r.getMessage() for r in caplog.records] == [
        "--rdzv-conf: the c10d rendezvous does not use timeout; ignored"]
    with pytest.raises(RendezvousConfigError, match="read_timeout=7'"):
        registry.create_handler(params("c10d", path, store_type="file", read_timeout="7'"))


def test_static_reads_only_rank_and_timeout(caplog):
    with caplog.at_level("WARNING", logger="elaunch"):
        registry.create_handler(params("static", "127.0.0.1:29599", max_nodes=2, rank=1, join_timeout=5, timeout=9))
    assert [r.getMessage() for r in caplog.records] == [
        "--rdzv-conf: the static rendezvous does not use join_timeout; ignored"]


def test_user_backend_names_leave_out_the_internal_standalone():
    assert registry.user_backend_names() == ("static", "c10d", "etcd", "etcd-v2", "etcd-v3")


def test_built_in_names_never_read_the_entry_points():
    # torchrun.handlers is consulted only for a name that is not built in: start-up
    # with c10d/static/standalone does not scan the installed packages
    code = ("import importlib.metadata as m\n"
            "def scan(*a, **k): raise AssertionError('entry points scanned')\n"
            "m.entry_points = scan\n"
            "from elaunch.config.values import parse_backend\n"
            "import elaunch.rendezvous.registry as r\n"
            "assert [parse_backend(n) for n in r.user_backend_names()] == list(r.user_backend_names())\n"
            "r.create_handler(r.RendezvousParameters('standalone', '', 'j', 1, 1)).next_rendezvous()\n"
            "r.create_handler(r.RendezvousParameters('static', '127.0.0.1:29500', 'j', 1, 1, {'rank': '0'}))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_torchrun_handlers_entry_point_is_a_user_backend():
    # registered by tests/plugins/elaunch_test_plugin (scripts/setup.sh --test installs it)
    assert registry.is_user_backend("elaunch-test-c10d")
    assert not registry.is_builtin("elaunch-test-c10d") and registry.is_builtin("c10d")
    assert not registry.is_user_backend("zookeeper") and not registry.is_user_backend("standalone")
    assert "elaunch-test-c10d" in registry.plugin_backend_names()
