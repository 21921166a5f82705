"""A real Prometheus server for tests: own config, own TSDB, scraping given targets every second.

Importable by any test (``from tests.prometheus_server import PrometheusServer``); the
fixtures that start one are in ``tests/integration/conftest.py``. Uses the ``prometheus``
binary (Debian ``prometheus`` 2.42; ``scripts/install-prometheus.sh``). The process is a
child of the caller, with its config file and TSDB directory under the directory it is
given, and is stopped and reaped by :meth:`PrometheusServer.stop` (call it in a
``finally``/fixture teardown).

For a network-namespace host pass ``host`` (an address of that host) and ``cmd_prefix``
(e.g. ``["ip", "netns", "exec", "h1"]``): the server runs there, and every HTTP request
to it is made from there too (a short Python process under the same prefix), since the
namespace's address is not reachable from the caller's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tests.etcd_server import free_ports


def prometheus_binary() -> str | None:
    """Return the path of the ``prometheus`` binary, or None when it is not installed."""
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)


def promtool_binary() -> str | None:
    """Return the path of ``promtool`` (shipped with the ``prometheus`` package), or None."""
    return shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)


#: Run under a host's ``cmd_prefix``: GET argv[1], write the body (also of an HTTP error) to stdout.
_FETCH = ("import sys, urllib.error, urllib.request\n"
          "try:\n"
          "    body = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read()\n"
          "except urllib.error.HTTPError as e:\n"
          "    body = e.read()\n"
          "sys.stdout.buffer.write(body)\n")


class PrometheusError(RuntimeError):
    """The HTTP API answered with ``"status": "error"`` (a bad expression, a bad time)."""


class PrometheusServer:
    """One ``prometheus`` process scraping ``targets`` (``host:port``, path ``/metrics``).

    Args:
        base_dir: a temp dir; gets ``prometheus.yml``, ``tsdb/`` and ``prometheus.log``.
        targets: ``host:port`` of each target, all in one scrape job named ``job``.
        scrape_interval: seconds between scrapes of each target (Prometheus accepts >= 1 ms;
            the tests use 1 s, the shortest a deployment would use).
        host: the address the web UI and HTTP API listen on (loopback by default).
        port: that port (a free one by default).
        cmd_prefix: prepended to the command (``ip netns exec HOST``).
        job: the ``job`` label of the scraped series.
    """

    def __init__(self, base_dir: Path, targets: list[str], scrape_interval: float = 1.0,
                 host: str = "127.0.0.1", port: int | None = None, cmd_prefix: list[str] | None = None,
                 job: str = "elaunch") -> None:
        self.base_dir = Path(base_dir)
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.host = host
        self.port = port
        self.cmd_prefix = list(cmd_prefix or [])
        self.job = job
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the HTTP API."""
        return f"http://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.base_dir / "prometheus.yml"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "prometheus.log"

    def _write_config(self) -> None:
        # JSON is YAML: no yaml library needed to write it
        interval = f"{int(round(self.scrape_interval * 1000))}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": f"{max(1, int(round(self.scrape_interval * 1000)) - 100)}ms"},
            "scrape_configs": [{"job_name": self.job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": self.targets}]}],
        }
        self.config_file.write_text(json.dumps(config, indent=2) + "\n")

    def _cmd(self) -> list[str]:
        return [*self.cmd_prefix, prometheus_binary() or "prometheus",
                f"--config.file={self.config_file}", f"--storage.tsdb.path={self.base_dir / 'tsdb'}",
                f"--web.listen-address={self.host}:{self.port}", "--web.enable-lifecycle",
                "--log.level=warn"]

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Write the config, start the process and wait until ``/-/ready`` answers 200.

        Raises:
            RuntimeError: the binary is missing.
            TimeoutError: not ready within ``timeout`` seconds, or it exited; the message has its log's
                tail. The process is stopped then.
        """
        if prometheus_binary() is None:
            raise RuntimeError("prometheus is not installed (run scripts/install-prometheus.sh)")
        assert self.proc is None, "already started"
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            # a fresh network namespace has every port free: pick one free here
            self.port = free_ports("127.0.0.1" if self.cmd_prefix else self.host, 1)[0]
        self._write_config()
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(self._cmd(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self) -> bool:
        """True when the process runs and ``GET /-/ready`` answers that it is ready (200; 503 before)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return b"is Ready" in self._get("/-/ready", timeout=1.0)  # 503 "Service Unavailable" before
        except (OSError, urllib.error.URLError, subprocess.SubprocessError):
            return False

    def _get(self, path: str, timeout: float = 5.0) -> bytes:
        """GET ``path``: the body (an HTTP error's too: the API's errors are JSON with 400/422).

        Raises:
            OSError / urllib.error.URLError: no answer; subprocess.TimeoutExpired: the fetch
                under ``cmd_prefix`` hung.
        """
        url = f"{self.url}{path}"
        if self.cmd_prefix:
            r = subprocess.run([*self.cmd_prefix, sys.executable, "-c", _FETCH, url, str(timeout)],
                               capture_output=True, timeout=timeout + 10)
            if r.returncode != 0:
                raise OSError(f"GET {url} from {' '.join(self.cmd_prefix)}: {r.stderr.decode(errors='replace')[-300:]}")
            return r.stdout
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            return e.read()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until :meth:`ready`.

        Raises:
            TimeoutError: the deadline (``timeout`` seconds) passed or the process exited; with its log.
        """
        deadline = time.monotonic() + timeout
        while not self.ready():
            exited = self.proc is None or self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                raise TimeoutError(f"prometheus at {self.url} not ready "
                                   f"({'exited' if exited else f'after {timeout}s'}):\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the process (SIGTERM, SIGKILL after ``timeout`` seconds) and reap it; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    def log_tail(self, n: int = 30) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])

    # -- the HTTP API ---------------------------------------------------------------------

    def api(self, path: str, **params: str | float) -> dict | list:
        """GET ``/api/v1/<path>`` with ``params``; return its ``data``.

        Raises:
            PrometheusError: the API answered ``status: error`` (its message included).
            OSError / urllib.error.URLError: the server did not answer.
        """
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        body = json.loads(self._get(f"/api/v1/{path}?{query}") or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Evaluate the PromQL ``expr`` (an instant query at Unix time ``at``, default now).

        Returns:
            The result's series: ``[{"metric": {label: value}, "value": float}, ...]`` (a scalar
            result comes back as one series without labels).

        Raises:
            PrometheusError: a bad expression.
        """
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The value of ``expr``'s single series, or None when it has none.

        Raises:
            AssertionError: more than one series (aggregate in the expression).
        """
        series = self.query(expr, at)
        assert len(series) <= 1, f"{expr!r} has {len(series)} series: {series}"
        return series[0]["value"] if series else None

    def active_targets(self) -> list[dict]:
        """``/api/v1/targets``' active targets (``scrapeUrl``, ``health``: up/down/unknown, ``lastError``)."""
        return self.api("targets", state="active")["activeTargets"]

    def wait_scraped(self, timeout: float = 30.0) -> None:
        """Wait until every target was scraped successfully at least once (health ``up``).

        Raises:
            TimeoutError: not within ``timeout`` seconds; names each target's health and last error.
        """
        deadline = time.monotonic() + timeout
        while True:
            targets = self.active_targets()
            if len(targets) == len(self.targets) and all(t["health"] == "up" for t in targets):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("targets not scraped: " + "; ".join(
                    f"{t['scrapeUrl']} {t['health']} {t['lastError']}" for t in targets))
            time.sleep(0.1)


def ensure_prometheus() -> str | None:
    """Return the prometheus binary, running ``scripts/install-prometheus.sh`` first when it is missing.

    Returns None when it is missing and could not be installed (no root, no network).
    """
    if prometheus_binary() is None:
        script = Path(__file__).resolve().parents[1] / "scripts" / "install-prometheus.sh"
        try:
            subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError):
            return None
    return prometheus_binary()
