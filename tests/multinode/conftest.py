"""Fixtures for multi-node tests: a bridged network of namespace hosts, agents inside them.

``net`` gives a fresh :class:`~tests.multinode.netns.Network` per test and removes
it (killing anything left inside its hosts) even when the test fails. Agents run
as ``ip netns exec <ns> <python> -m elaunch ...`` with ``--local-addr`` set to the
host's address and ``GLOO_SOCKET_IFNAME`` to its interface; their output goes to
files so a test can wait on lines without pipes filling up.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for
from tests.helpers import launcher_env
from tests.multinode import netns

STORE_PORT = 29400


@pytest.fixture(scope="session")
def _netns_ready():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    netns.cleanup_stale()


@pytest.fixture
def net(_netns_ready):
    """A new bridged network (no hosts yet); everything is deleted afterwards."""
    network = netns.Network()
    try:
        yield network
    finally:
        network.close()


class Agent:
    """One elaunch agent running inside a host; stdout/stderr go to files.

    Attributes:
        host: where it runs.
        proc: the Popen of ``ip netns exec`` (which execs, so ``proc.pid`` is the agent).
        out, err: paths of its stdout and stderr files.
    """

    def __init__(self, host: netns.Host, argv: list[str], logdir: Path, name: str, env: dict | None = None):
        self.host = host
        self.name = name
        self.out = logdir / f"{name}.out"
        self.err = logdir / f"{name}.err"
        full_env = launcher_env(GLOO_SOCKET_IFNAME=host.ifname, MN_HOST=host.addr, PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = host.popen([sys.executable, "-m", "elaunch", *argv], stdout=o, stderr=e, env=full_env)

    def __repr__(self) -> str:
        return f"Agent({self.name} on {self.host.addr}, pid {self.proc.pid})"

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def kill9(self) -> None:
        """SIGKILL the agent process itself (not its workers)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the agent to exit; return its exit code.

        Raises:
            AssertionError: it is still running after ``timeout`` (it is killed,
                and its output is in the message).
        """
        try:
            return self.proc.wait(timeout=timeout)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self} did not exit within {timeout}s\n{self.describe()}")

    def describe(self) -> str:
        return f"--- {self.name} stdout ---\n{self.stdout[-3000:]}\n--- {self.name} stderr ---\n{self.stderr[-3000:]}"


def agent_args(host: netns.Host, endpoint: str, *, nnodes: str, nproc: int = 2, rdzv_id: str = "job",
               backend: str = "c10d", conf: str = "", extra=()) -> list[str]:
    """The elaunch flags for an agent on ``host`` meeting the others at ``endpoint``.

    Short timeouts (seconds): last call 2, keep-alive every 1 with 3 attempts, store reads 20.
    """
    base_conf = "last_call_timeout=2,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=20"
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={base_conf + (',' + conf if conf else '')}",
        f"--local-addr={host.addr}",
        "--monitor-interval=0.2",
        "--shutdown-timeout=5",
        *extra,
    ]


@pytest.fixture
def agents(net, tmp_path):
    """Factory ``start(host, argv, name)`` -> Agent; every agent and host process is killed afterwards."""
    started: list[Agent] = []

    def start(host: netns.Host, argv: list[str], name: str | None = None, env: dict | None = None) -> Agent:
        a = Agent(host, argv, tmp_path, name or f"agent{len(started)}", env)
        started.append(a)
        return a

    yield start
    for a in started:
        if a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(timeout=10)
    for h in net.hosts:
        netns.kill_namespace_processes(h.ns)


def no_processes_in(hosts, timeout: float = 20.0) -> None:
    """Wait until no process runs inside any of ``hosts`` (service hosts, e.g. etcd's, excluded).

    Raises:
        AssertionError: some host still runs processes after ``timeout`` s (named).
    """
    hosts = [h for h in hosts if not h.service]

    def empty():
        return not any(h.pids() for h in hosts)

    try:
        wait_for(empty, timeout, interval=0.2, what="hosts to have no processes")
    except AssertionError:
        left = {}
        for h in hosts:
            for pid in h.pids():
                try:
                    left[pid] = (h.ns, " ".join(psutil.Process(pid).cmdline())[:150])
                except psutil.Error:
                    pass
        if left:
            raise AssertionError(f"processes left in the hosts: {left}") from None


def wait_text(path: Path, text: str, timeout: float, agents_alive=()) -> str:
    """Wait until file ``path`` contains ``text``; return the file's content.

    Raises:
        AssertionError: deadline passed, or one of ``agents_alive`` exited first
            (its output is in the message).
    """
    deadline = time.monotonic() + timeout

    def check():
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content or True
        for a in agents_alive:
            if a.proc.poll() is not None:
                raise AssertionError(f"{a} exited ({a.proc.returncode}) before {text!r} appeared in {path.name}\n"
                                     f"{a.describe()}")
        return None

    return wait_for(check, max(0.0, deadline - time.monotonic()), interval=0.1, what=f"{text!r} in {path}")


def worker_envs(host: netns.Host) -> list[dict[str, str]]:
    """Environments of the elaunch workers running inside ``host`` (those with RANK set)."""
    envs = []
    for pid in host.pids():
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            envs.append(env)
    return envs


def world_running(hosts, world_size: int, nproc: int = 2) -> bool:
    """True when every (non-service) host runs ``nproc`` workers, all with WORLD_SIZE ``world_size``."""
    for h in (h for h in hosts if not h.service):
        sizes = [e.get("WORLD_SIZE") for e in worker_envs(h)]
        if len(sizes) != nproc or set(sizes) != {str(world_size)}:
            return False
    return True


# -- rendezvous endpoints: c10d on the first host, etcd in a host of its own ---------------

BACKENDS = ["c10d", "etcd-v2", "etcd-v3"]


def _etcd_cluster_class():
    from tests.etcd_server import EtcdCluster

    class NetnsEtcdCluster(EtcdCluster):
        """An EtcdCluster whose members run in namespace hosts: health is checked from inside them."""

        hosts: dict[str, netns.Host] = {}

        def healthy(self, m) -> bool:
            if m.proc is None or m.proc.poll() is not None:
                return False
            probe = ("import json,sys,urllib.request as u;"
                     f"r=u.urlopen('http://{m.host}:{m.client_port}/health',timeout=2);"
                     "sys.exit(0 if str(json.loads(r.read()).get('health'))=='true' else 1)")
            try:
                return self.hosts[m.name].run([sys.executable, "-c", probe], timeout=10).returncode == 0
            except Exception:  # noqa: BLE001 - not healthy yet
                return False

    return NetnsEtcdCluster


def etcd_unavailable_reason(backend: str) -> str | None:
    """Why ``backend`` (etcd-v2/etcd-v3) cannot run here, or None."""
    try:
        from tests.etcd_server import etcd_binary
    except ImportError:
        return "tests/etcd_server.py is not available"
    if etcd_binary() is None:
        return "etcd is not installed (scripts/install-etcd.sh)"
    module = {"etcd-v2": "etcd", "etcd-v3": "pyetcd"}[backend]
    try:
        __import__(module)
    except ImportError:
        return f"{module} missing: pip install 'elaunch[etcd]'"
    return None


class Rendezvous:
    """Where a test's agents meet: ``backend`` and the ``endpoint`` to pass them.

    For c10d the endpoint is the first host's address (its agent hosts the store);
    for etcd-v2/etcd-v3 an etcd member runs in an extra host of its own (v2 API
    enabled for etcd-v2, v3 only for etcd-v3), created by :meth:`endpoint`.
    """

    def __init__(self, backend: str, net: netns.Network, tmp_path: Path) -> None:
        self.backend = backend
        self._net = net
        self._tmp = tmp_path
        self.cluster = None
        self.etcd_host: netns.Host | None = None

    def endpoint(self, store_host: netns.Host) -> str:
        """Return ``--rdzv-endpoint``; for etcd, start the member (once) in a new host."""
        if self.backend == "c10d":
            return f"{store_host.addr}:{STORE_PORT}"
        if self.cluster is None:
            from tests.etcd_server import EtcdMember

            h = self._net.add_host()
            h.service = True
            self.etcd_host = h
            base = self._tmp / "etcd"
            base.mkdir(exist_ok=True)
            member = EtcdMember("m0", h.addr, 2379, 2380, base / "m0.etcd", ["ip", "netns", "exec", h.ns])
            cls = _etcd_cluster_class()
            cluster = cls([member], self.backend == "etcd-v2", None, base)
            cluster.hosts = {"m0": h}
            self.cluster = cluster
            cluster.start(30)
        return self.cluster.endpoints

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


@pytest.fixture(params=BACKENDS)
def rdzv(request, net, tmp_path):
    """A Rendezvous for each backend (etcd ones skipped, with the reason, when unavailable)."""
    if request.param != "c10d":
        reason = etcd_unavailable_reason(request.param)
        if reason:
            pytest.skip(f"{request.param}: {reason}")
    r = Rendezvous(request.param, net, tmp_path)
    try:
        yield r
    finally:
        r.stop()
