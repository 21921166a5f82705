"""A real etcd server for the benchmark's etcd rows (rendezvous scale, job-wide abort).

One member on free loopback ports, v2 API enabled (``--enable-v2``, which torchrun's
``etcd``/``etcd-v2`` backends need; the v3 API is served as always), a temp data dir
removed on :meth:`EtcdServer.stop`. The benchmark's own copy of what
``tests/etcd_server.py`` does for the tests, so that ``benchmarks`` does not import
the test package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.common import free_port


def etcd_binary() -> str | None:
    """The ``etcd`` server binary (PATH, else /usr/bin/etcd), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


class EtcdServer:
    """One etcd member on free loopback ports with a temp data dir, v2 API enabled (``--enable-v2``).

    :meth:`start` it, then :meth:`stop` it in a ``finally`` (or use it as a context
    manager): the process is stopped (SIGTERM, SIGKILL after 10 s) and the data dir
    removed, whatever happened.

    Args:
        binary: the ``etcd`` executable.
        timeout: seconds to wait until ``/health`` reports true.
    """

    def __init__(self, binary: str, timeout: float = 30.0) -> None:
        self.binary = binary
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self.client_port = 0

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client URL."""
        return f"127.0.0.1:{self.client_port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as resp:
                return str(json.loads(resp.read() or b"{}").get("health")) == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "etcd.log"), errors="replace") as f:
                return " / ".join(f.read().splitlines()[-3:])[-400:]
        except OSError:
            return ""

    def start(self) -> EtcdServer:
        """Start etcd (up to 3 tries on fresh ports) and wait until healthy.

        Raises:
            RuntimeError: it exited or was not healthy within ``timeout`` seconds;
                the message has the end of its log. The server is stopped then.
        """
        self.dir = tempfile.mkdtemp(prefix="elaunch-bench-etcd-")
        try:
            for attempt in range(3):
                self.client_port, peer = free_port(), free_port()
                client_url, peer_url = f"http://{self.endpoint}", f"http://127.0.0.1:{peer}"
                cmd = [self.binary, "--name", "bench", "--data-dir", os.path.join(self.dir, f"data{attempt}"),
                       "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                       "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                       "--initial-cluster", f"bench={peer_url}", "--initial-cluster-state", "new",
                       "--enable-v2=true", "--log-level", "warn", "--logger", "zap"]
                with open(os.path.join(self.dir, "etcd.log"), "ab") as log:
                    self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                deadline = time.monotonic() + self.timeout
                while self.proc.poll() is None and time.monotonic() < deadline:
                    if self._healthy():
                        return self
                    time.sleep(0.1)
                if self.proc.poll() is None:  # alive but not healthy in time: no retry
                    raise RuntimeError(f"etcd not healthy within {self.timeout:g} s: {self._log_tail()}")
                self.proc = None  # exited (e.g. a port taken meanwhile): fresh ports
            raise RuntimeError(f"etcd exited at start: {self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the process and remove the data dir; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def missing_for_etcd(backends: tuple[str, ...]) -> str | None:
    """Why elaunch cannot run an etcd row here (``etcd: skipped (...)``), or None when it can.

    Args:
        backends: the elaunch rendezvous backends the row uses (``etcd-v2``, ``etcd-v3``).
            Both etcd clients (python-etcd for v2 and torchrun, etcd-sdk-python for v3)
            and the server binary are required.
    """
    import importlib.util

    from elaunch.rendezvous.registry import backend_names

    if absent := [b for b in backends if b not in backend_names()]:
        return f"etcd: skipped (elaunch has no {', '.join(absent)} backend)"
    missing = [m for m in ("pyetcd", "etcd") if importlib.util.find_spec(m) is None]
    if missing:
        return f"etcd: skipped (Python module(s) {', '.join(missing)} missing: pip install -e '.[etcd]')"
    if etcd_binary() is None:
        return "etcd: skipped (no etcd server binary on PATH)"
    return None
