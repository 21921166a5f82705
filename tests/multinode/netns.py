"""Test hosts as Linux network namespaces joined by a bridge.

A :class:`Network` owns one "switch" namespace holding a bridge, and any number of
:class:`Host` namespaces. Each host gets a veth pair created directly between its
namespace (end ``eth0``, address ``192.168.77.<n>/24``) and the switch namespace
(end ``h<n>``, enslaved to the bridge). Nothing is created in the root namespace:
the addresses exist only inside the namespaces, and deleting the namespaces
deletes the veths and the bridge with them.

Names are ``elt-<owner pid>-<random>-<role>`` so that concurrent sessions never
clash and :func:`cleanup_stale` can remove what a crashed earlier session (whose
pid is gone) left behind.

Needs root and ``ip`` (iproute2); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

import psutil

PREFIX = "elt-"
#: Per-namespace configuration: ``ip netns exec NS`` bind-mounts ``/etc/netns/NS/<file>``
#: over ``/etc/<file>`` for the command it runs (``Host.set_hosts``).
ETC_NETNS = "/etc/netns"
SUBNET = "192.168.77"
HOST_IFNAME = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; raise RuntimeError with its stderr when ``check`` and it fails."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Return the names of all named network namespaces (``ip netns list``)."""
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Return the pids of the processes inside namespace ``ns`` (``ip netns pids``)."""
    res = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in res.stdout.split() if x.strip().isdigit()]


def unavailable_reason() -> str | None:
    """Return why network-namespace hosts cannot be built here, or None if they can."""
    if os.geteuid() != 0:
        return "multi-node tests need root to create network namespaces"
    if shutil.which("ip") is None:
        return "multi-node tests need the 'ip' command (iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"'ip netns add' is not permitted here: {res.stderr.strip()}"
    try:
        res = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"cannot create a bridge in a network namespace: {res.stderr.strip()}"
        res = _ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb", check=False)
        if res.returncode != 0:
            return f"cannot create a veth pair in a network namespace: {res.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def kill_namespace_processes(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process inside ``ns`` and wait (up to ``timeout`` s) for them to go.

    Returns:
        The pids that were found (and killed).
    """
    procs = sigkill_namespace_processes(ns)
    psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in procs]


def sigkill_namespace_processes(ns: str, nice: int | None = None) -> list[psutil.Process]:
    """SIGKILL every process inside ``ns`` without waiting for them to go (``psutil.wait_procs`` them).

    ``nice``: first set each process's nice value, which its exit (freeing its memory) runs at.
    """
    procs = []
    for pid in namespace_pids(ns):
        try:
            p = psutil.Process(pid)
            if nice is not None:
                for tid in os.listdir(f"/proc/{pid}/task"):  # nice is per thread on Linux
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                    except OSError:
                        pass
            p.send_signal(signal.SIGKILL)
            procs.append(p)
        except (psutil.Error, OSError):
            pass
    return procs


def delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns``, then delete it (its veth ends and bridge go with it) and its /etc/netns files."""
    kill_namespace_processes(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix><pid>-...`` whose owner pid no longer runs.

    Namespaces of live sessions (including this one) are left alone.

    Returns:
        The deleted namespace names.
    """
    gone = []
    for ns in list_namespaces():
        owner = ns[len(prefix):].split("-", 1)[0] if ns.startswith(prefix) else ""
        if not owner.isdigit() or psutil.pid_exists(int(owner)):
            continue
        delete_namespace(ns)
        gone.append(ns)
    return gone


class Host:
    """One test host: a network namespace with ``eth0`` at ``addr`` on the bridge.

    Attributes:
        index: host number n >= 1 (address ``192.168.77.<n>``).
        ns: the namespace name.
        addr: its IPv4 address (no prefix length).
        ifname: its interface name inside the namespace (for ``GLOO_SOCKET_IFNAME``).
        peer: the bridge-side veth end's name, in the switch namespace.
        service: True for a host that runs infrastructure (e.g. etcd), not agents.
    """

    def __init__(self, network: Network, index: int) -> None:
        self.network = network
        self.index = index
        self.ns = f"{network.name}-h{index}"
        self.addr = f"{SUBNET}.{index}"
        self.ifname = HOST_IFNAME
        self.peer = f"h{index}"
        self.service = False

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.addr})"

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """Return ``argv`` wrapped to run inside this host (``ip netns exec NS ...``).

        ``ip netns exec`` execs ``argv``, so the started process's pid is argv's own.
        """
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside this host; ``kw`` goes to ``subprocess.Popen``."""
        return subprocess.Popen(self.cmd(argv), **kw)

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to completion (text output captured)."""
        return subprocess.run(self.cmd(argv), capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        """Pids of the processes running inside this host."""
        return namespace_pids(self.ns)

    def set_hosts(self, records: dict[str, str]) -> None:
        """Make each ``name -> address`` of ``records`` resolve inside this host, as DNS would.

        Writes ``/etc/netns/<ns>/hosts``: the machine's ``/etc/hosts`` followed by the
        records. ``ip netns exec`` mounts it over ``/etc/hosts`` for commands started
        afterwards; :meth:`delete` removes it.
        """
        d = os.path.join(ETC_NETNS, self.ns)
        os.makedirs(d, exist_ok=True)
        with open("/etc/hosts") as fp:
            base = fp.read()
        lines = "".join(f"{addr} {name}\n" for name, addr in records.items())
        with open(os.path.join(d, "hosts"), "w") as fp:
            fp.write(base.rstrip("\n") + "\n" + lines)

    def link_down(self) -> None:
        """Cut this host off the network (``ip link set eth0 down`` inside it)."""
        _ip("-n", self.ns, "link", "set", self.ifname, "down")

    def link_up(self) -> None:
        """Reconnect this host (``ip link set eth0 up`` inside it)."""
        _ip("-n", self.ns, "link", "set", self.ifname, "up")

    def _create(self) -> None:
        sw = self.network.switch
        _ip("netns", "add", self.ns)
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", self.peer, "type", "veth", "peer", "name", self.ifname, "netns", self.ns)
        _ip("-n", sw, "link", "set", self.peer, "master", self.network.bridge)
        _ip("-n", sw, "link", "set", self.peer, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", self.ifname)
        _ip("-n", self.ns, "link", "set", self.ifname, "up")

    def delete(self) -> None:
        """Kill what runs inside this host and delete its namespace."""
        delete_namespace(self.ns)


class Network:
    """A bridge in its own namespace and the hosts attached to it.

    Use as a context manager, or call :meth:`close` in a ``finally``: it kills every
    process left in the hosts and deletes all namespaces it created.

    Args:
        tag: an optional readable part of the names (keep it short).
    """

    def __init__(self, tag: str = "") -> None:
        rand = secrets.token_hex(2)
        self.name = f"{PREFIX}{os.getpid()}-{rand}{tag}"
        self.switch = f"{self.name}-sw"
        self.bridge = "br0"
        self.hosts: list[Host] = []
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", self.bridge, "up")
        except Exception:
            self.close()
            raise

    def add_host(self) -> Host:
        """Create the next host (address ``192.168.77.<n>``, n = 1, 2, ...) and return it."""
        host = Host(self, len(self.hosts) + 1)
        self.hosts.append(host)
        host._create()
        return host

    def close(self) -> None:
        """Kill processes in every host, delete the hosts and the switch namespace."""
        for h in self.hosts:
            h.delete()
        delete_namespace(self.switch)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
