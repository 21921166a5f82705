"""Real etcd servers for tests: one member or a 3-member cluster, v2 or v3 only, TLS, auth.

Importable by any test (``from tests.etcd_server import start_cluster``). Uses the
``etcd`` binary (Debian ``etcd-server`` 3.4.23; ``scripts/install-etcd.sh``). Every
process is a child of the caller, started with its own temp data dir, and is
stopped by :meth:`EtcdCluster.stop` (call it in a ``finally``/fixture teardown).

For network-namespace hosts pass ``host`` (the member's IP) and ``cmd_prefix``
(e.g. ``["ip", "netns", "exec", "h1"]``) per member.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass, field
from pathlib import Path


def etcd_binary() -> str | None:
    """Return the path of the ``etcd`` binary, or None when it is not installed."""
    return shutil.which("etcd") or (("/usr/bin/etcd") if os.access("/usr/bin/etcd", os.X_OK) else None)


def free_ports(host: str, n: int) -> list[int]:
    """Return ``n`` distinct TCP ports free on ``host`` right now (all bound at once while picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA, a server certificate (for 127.0.0.1/localhost) and a client one."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_tls(directory: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> TlsFiles:
    """Generate a CA, a server cert valid for ``ips`` + localhost, and a client cert (``openssl`` CLI).

    Raises:
        subprocess.CalledProcessError: openssl failed.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def ssl_(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ssl_("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "2", "-subj", "/CN=elaunch-test-ca")
    san = ",".join(["DNS:localhost", *(f"IP:{ip}" for ip in ips)])
    for name in ("server", "client"):
        ssl_("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN=elaunch-{name}")
        (d / f"{name}.ext").write_text(
            f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
        ssl_("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return TlsFiles(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"),
                    str(d / "client.pem"), str(d / "client.key"))


@dataclass
class EtcdMember:
    """One etcd process: its name, addresses, data dir, and the running process (or None)."""

    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    cmd_prefix: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what ``--rdzv-endpoint`` takes)."""
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def send(self, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP / SIGCONT) to the member's process."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the process (``sig`` first, SIGKILL after ``timeout`` seconds) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a SIGSTOPped member must be able to die
                proc.send_signal(sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
            except ProcessLookupError:
                pass
        if proc.stdout:
            proc.stdout.close()

    def kill(self) -> None:
        """SIGKILL the member (an abrupt crash)."""
        self.stop(signal.SIGKILL)


class EtcdCluster:
    """A set of etcd members started together (1 or 3), v2 API on or off, optional TLS/auth.

    Args:
        members: the members (see :func:`start_cluster`, which fills this in).
        v2: serve the v2 API (``--enable-v2``), needed by the ``etcd``/``etcd-v2`` backends.
        tls: server certificates; clients then must use https and present a client cert.
        log_dir: where each member's log goes.
    """

    def __init__(self, members: list[EtcdMember], v2: bool, tls: TlsFiles | None, log_dir: Path) -> None:
        self.members = members
        self.v2 = v2
        self.tls = tls
        self.log_dir = log_dir
        self.auth: tuple[str, str] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoints(self) -> str:
        """Comma-separated ``host:port`` of every member (the ``--rdzv-endpoint`` value)."""
        return ",".join(m.endpoint for m in self.members)

    def _cmd(self, m: EtcdMember) -> list[str]:
        c = f"{self.scheme}://{m.host}:{m.client_port}"
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        cmd = [*m.cmd_prefix, etcd_binary() or "etcd", "--name", m.name, "--data-dir", str(m.data_dir),
               "--listen-client-urls", c, "--advertise-client-urls", c,
               "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
               "--initial-cluster", initial, "--initial-cluster-state", "new",
               "--initial-cluster-token", f"elaunch-test-{self.members[0].client_port}",
               "--enable-v2=" + ("true" if self.v2 else "false"), "--log-level", "warn", "--logger", "zap"]
        if self.tls:
            t = self.tls
            cmd += ["--cert-file", t.server_cert, "--key-file", t.server_key, "--trusted-ca-file", t.ca,
                    "--client-cert-auth"]
        return cmd

    def start_member(self, m: EtcdMember) -> None:
        """(Re)start member ``m`` on its ports and data dir (after a stop/kill)."""
        assert m.proc is None or m.proc.poll() is not None, f"{m.name} already runs"
        m.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{m.name}.log", "ab")
        try:
            m.proc = subprocess.Popen(self._cmd(m), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait (``timeout`` seconds) until all are healthy."""
        for m in self.members:
            self.start_member(m)
        self.wait_healthy(timeout)
        return self

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL); safe to call twice."""
        for m in self.members:
            m.stop()

    # -- HTTP (grpc-gateway / v2 health) -------------------------------------------------

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return ctx

    def request(self, m: EtcdMember, path: str, body: dict | None = None, token: str | None = None,
                timeout: float = 2.0) -> dict:
        """POST (or GET when ``body`` is None) JSON to member ``m``; return the decoded reply.

        Raises:
            OSError / urllib.error.URLError: the member did not answer.
        """
        url = f"{self.scheme}://{m.host}:{m.client_port}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
        if token:
            req.add_header("Authorization", token)
        with urllib.request.urlopen(req, timeout=timeout, context=self._ssl()) as resp:
            return json.loads(resp.read() or b"{}")

    def healthy(self, m: EtcdMember) -> bool:
        """True when ``m`` runs and reports ``/health`` true (it has a leader)."""
        if m.proc is None or m.proc.poll() is not None:
            return False
        try:
            return str(self.request(m, "/health").get("health")) == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = 30.0, members: list[EtcdMember] | None = None) -> None:
        """Wait until every running member (or ``members``) is healthy.

        Raises:
            TimeoutError: not healthy within ``timeout`` seconds; names the members and their log.
        """
        targets = members if members is not None else [m for m in self.members if m.proc is not None]
        deadline = time.monotonic() + timeout
        while True:
            bad = [m for m in targets if not self.healthy(m)]
            if not bad:
                return
            dead = [m for m in bad if m.proc is None or m.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {m.name}:\n{self.log_tail(m)}" for m in bad)
                raise TimeoutError(f"etcd member(s) {[m.name for m in bad]} not healthy "
                                   f"({'exited' if dead else f'after {timeout}s'}):\n{logs}")
            time.sleep(0.1)

    def log_tail(self, m: EtcdMember, n: int = 20) -> str:
        path = self.log_dir / f"{m.name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def leader(self, timeout: float = 15.0) -> EtcdMember:
        """Return the current leader member (waits up to ``timeout`` seconds for one).

        Raises:
            TimeoutError: no running member reports a leader.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is None:
                    continue
                try:
                    st = self.request(m, "/v3/maintenance/status", {})
                except (OSError, ValueError, urllib.error.URLError):
                    continue
                if st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                    return m
            time.sleep(0.1)
        raise TimeoutError("no etcd leader")

    def make_leader(self, m: EtcdMember, timeout: float = 15.0) -> None:
        """Move the leadership to member ``m`` (etcd's MoveLeader, sent to the leader); return once it leads.

        Raises:
            TimeoutError: ``m`` does not lead within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while (leader := self.leader(timeout)) is not m:
            member_id = self.request(m, "/v3/maintenance/status", {})["header"]["member_id"]
            try:
                self.request(leader, "/v3/maintenance/transfer-leadership", {"targetID": member_id}, timeout=5.0)
            except (OSError, ValueError, urllib.error.URLError):
                pass  # an election in between: ask the new leader
            if time.monotonic() > deadline:
                raise TimeoutError(f"{m.name} did not become the etcd leader")

    def enable_auth(self, user: str = "root", password: str = "elaunch-secret") -> tuple[str, str]:
        """Create ``user`` (with the root role) and turn authentication on; returns (user, password)."""
        m = next(x for x in self.members if x.proc is not None)
        self.request(m, "/v3/auth/role/add", {"name": "root"})
        self.request(m, "/v3/auth/user/add", {"name": user, "password": password})
        self.request(m, "/v3/auth/user/grant", {"user": user, "role": "root"})
        if user != "root":
            self.request(m, "/v3/auth/user/add", {"name": "root", "password": password})
            self.request(m, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.request(m, "/v3/auth/enable", {})
        self.auth = (user, password)
        return self.auth

    def put(self, key: str, value: str) -> None:
        """Write ``key`` through the v3 JSON gateway of the first running member (no auth)."""
        m = next(x for x in self.members if x.proc is not None)
        self.request(m, "/v3/kv/put", {"key": b64encode(key.encode()).decode(),
                                       "value": b64encode(value.encode()).decode()})


def start_cluster(base_dir: Path, size: int = 1, v2: bool = False, tls: TlsFiles | None = None,
                  hosts: list[str] | None = None, cmd_prefixes: list[list[str]] | None = None,
                  timeout: float = 30.0) -> EtcdCluster:
    """Start ``size`` etcd members on free ports and wait until healthy.

    Args:
        base_dir: a temp dir; each member gets ``base_dir/<name>`` as data dir.
        size: number of members (1 or 3).
        v2: enable the v2 API (``--enable-v2``).
        tls: serve https/TLS gRPC with these certificates and require client certs.
        hosts: each member's IP (default 127.0.0.1 for all).
        cmd_prefixes: each member's command prefix (e.g. ``ip netns exec h1``).
        timeout: seconds to wait for health.

    Raises:
        RuntimeError: the etcd binary is missing.
        TimeoutError: the cluster did not become healthy; the members are stopped.
    """
    if etcd_binary() is None:
        raise RuntimeError("etcd is not installed (run scripts/install-etcd.sh)")
    base_dir = Path(base_dir)
    base_dir.mkdir(parents=True, exist_ok=True)
    hosts = hosts or ["127.0.0.1"] * size
    for attempt in (1, 2):  # a port picked here can be taken before etcd binds it: try once more
        ports = iter(free_ports("0.0.0.0", 2 * size))  # free on 0.0.0.0: free on every address
        members = [EtcdMember(f"m{i}", hosts[i], next(ports), next(ports), base_dir / f"m{i}.etcd",
                              list((cmd_prefixes or [[]] * size)[i])) for i in range(size)]
        cluster = EtcdCluster(members, v2, tls, base_dir)
        try:
            return cluster.start(timeout)
        except TimeoutError:
            cluster.stop()
            if attempt == 2:
                raise
            for m in members:
                shutil.rmtree(m.data_dir, ignore_errors=True)
        except BaseException:
            cluster.stop()
            raise
    raise AssertionError("unreachable")
