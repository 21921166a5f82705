"""Fixtures shared by the integration tests: the example training's, and one rendezvous endpoint per backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, FIXTURE_PIDS
from tests.etcd.conftest import etcd_bin, etcd_v2, etcd_v3
from tests.helpers import free_port, run
from tests.prometheus_server import PrometheusServer, ensure_prometheus

ETCD_FIXTURES = (etcd_bin, etcd_v2, etcd_v3)  # imported for pytest to find; used through `endpoint`
EXAMPLE = str(EXAMPLES / "ddp_digits.py")
#: 3 epochs of 23 steps per rank at world size 2
SHORT = ("--epochs", "3")


def final_digest(path: Path) -> str:
    """The SHA-256 of the final parameters that ``--final-params`` wrote to ``path``."""
    return json.loads(path.read_text())["sha256"]


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory) -> str:
    """SHA-256 of the final parameters of an uninterrupted short run (seed 0, world size 2)."""
    tmp = tmp_path_factory.mktemp("reference")
    r = run("elaunch", "--standalone", "--nproc-per-node=2", EXAMPLE, *SHORT,
            "--checkpoint", str(tmp / "ck.pt"), "--final-params", str(tmp / "final.json"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return final_digest(tmp / "final.json")


@pytest.fixture
def endpoint(request):
    """``(backend, endpoint)`` for ``request.param`` (``c10d``, ``etcd-v2``, ``etcd-v3``); use it indirectly.

    c10d: a free loopback port (the first agent hosts the store); etcd: the module's
    etcd server, whose processes the leak check is told about.
    """
    backend = request.param
    if backend == "c10d":
        return backend, f"127.0.0.1:{free_port()}"
    cluster = request.getfixturevalue("etcd_v3" if backend == "etcd-v3" else "etcd_v2")
    FIXTURE_PIDS.update(m.proc.pid for m in cluster.members if m.proc is not None)  # module-scoped servers
    return backend, cluster.endpoints


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """The prometheus binary (installed by scripts/install-prometheus.sh if missing) or skip.

    The skip is a missing tool, not a case that does not apply: under CI it fails (tests/conftest.py).
    """
    path = ensure_prometheus()
    if path is None:
        pytest.skip("prometheus is not installed and scripts/install-prometheus.sh could not install it")
    return path


@pytest.fixture
def prometheus(prometheus_bin, tmp_path):
    """Start a real Prometheus scraping targets every second: ``prometheus(["127.0.0.1:PORT", ...])``.

    Returns the started, ready :class:`tests.prometheus_server.PrometheusServer` (loopback, own
    config and TSDB under ``tmp_path/prometheus``); every one started is stopped and reaped at teardown.
    """
    started: list[PrometheusServer] = []

    def make(targets: list[str], **kw) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus{len(started)}", targets, **kw)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.stop()
