"""Fixtures: real etcd servers (single member v2/v3-only, 3 members, TLS, auth) and handler factories.

Reusable by other test packages: ``from tests.etcd.conftest import ...`` or the
importable process manager ``tests.etcd_server``. Every etcd a fixture starts is
stopped at teardown, whatever the test's outcome.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elaunch.rendezvous import registry
from elaunch.rendezvous.contract import RendezvousParameters
from tests.etcd_server import EtcdCluster, etcd_binary, make_tls, start_cluster

REPO = Path(__file__).resolve().parents[2]


def _ensure_etcd() -> str | None:
    if etcd_binary() is None:
        try:
            subprocess.run(["bash", str(REPO / "scripts" / "install-etcd.sh")], check=True,
                           capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError):
            return None
    return etcd_binary()


@pytest.fixture(scope="session")
def etcd_bin() -> str:
    """The etcd binary (installed by scripts/install-etcd.sh if missing) or skip."""
    path = _ensure_etcd()
    if path is None:
        pytest.skip("etcd is not installed and scripts/install-etcd.sh could not install etcd-server")
    for module in ("etcd", "pyetcd"):
        pytest.importorskip(module, reason=f"{module} missing: pip install 'elaunch[etcd]'")
    return path


def _cluster(tmp_path_factory, name: str, **kw) -> EtcdCluster:
    return start_cluster(tmp_path_factory.mktemp(name), **kw)


@pytest.fixture(scope="module")
def etcd_v2(etcd_bin, tmp_path_factory):
    """One etcd member with the v2 API enabled (``--enable-v2``); module-scoped."""
    c = _cluster(tmp_path_factory, "etcd-v2", v2=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def etcd_v3(etcd_bin, tmp_path_factory):
    """One etcd member serving the v3 API only; module-scoped."""
    c = _cluster(tmp_path_factory, "etcd-v3")
    yield c
    c.stop()


@pytest.fixture
def etcd_fresh(etcd_bin, tmp_path):
    """A function-scoped single member (v2 enabled), for tests that stop/kill it."""
    c = start_cluster(tmp_path / "etcd", v2=True)
    yield c
    c.stop()


@pytest.fixture
def etcd_cluster3(etcd_bin, tmp_path):
    """A 3-member cluster (v3 only), function-scoped: tests kill members."""
    c = start_cluster(tmp_path / "etcd3", size=3)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tls_files(etcd_bin, tmp_path_factory):
    """A test CA, server and client certificates (openssl CLI)."""
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def etcd_tls(tls_files, tmp_path_factory):
    """One member serving TLS only and requiring client certificates (v2 enabled)."""
    c = _cluster(tmp_path_factory, "etcd-tls", v2=True, tls=tls_files)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def etcd_auth(etcd_bin, tmp_path_factory):
    """One member (v3) with authentication on; ``cluster.auth`` is (user, password)."""
    c = _cluster(tmp_path_factory, "etcd-auth")
    c.enable_auth("elaunch", "s3cret")
    yield c
    c.stop()


FAST = {"poll_interval": "0.1", "join_timeout": "30", "read_timeout": "10", "last_call_timeout": "0.5",
        "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}


def make_params(backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes,
                                config={**FAST, **{k: str(v) for k, v in conf.items()}},
                                local_addr="127.0.0.1", role="trainer", local_world_size=2)


@pytest.fixture
def handlers():
    """Create handlers with ``make(backend, endpoint, run_id, min, max, **conf)``; all shut down at the end."""
    made, pool = [], ThreadPoolExecutor(max_workers=6)

    class Factory:
        def make(self, *args, **kw):
            h = registry.create_handler(make_params(*args, **kw))
            made.append(h)
            return h

        def join(self, *hs):
            return list(pool.map(lambda h: h.next_rendezvous(), hs))

        def submit(self, fn, *args):
            return pool.submit(fn, *args)

    yield Factory()
    for h in made:
        try:
            h.shutdown()
        except Exception:  # noqa: BLE001 - etcd may be gone in fault tests
            pass
    pool.shutdown(wait=True)


@pytest.fixture
def etcd_cluster3_v2(etcd_bin, tmp_path):
    """A 3-member cluster with the v2 API on as well, function-scoped: tests kill members."""
    c = start_cluster(tmp_path / "etcd3v2", size=3, v2=True)
    yield c
    c.stop()
