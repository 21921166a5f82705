"""--metrics-port with a real agent: /metrics over HTTP, parsed as Prometheus parses it; the port goes with the agent.

The event -> metric mapping is in tests/unit/test_metrics.py; here a standalone job of two
workers restarts once after a crash, and a scrape through urllib shows it.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, kill_tree, launcher_env, port_open, start

pytestmark = pytest.mark.slow

URL = re.compile(r"metrics on http://(\S+):(\d+)/metrics")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels without run_id/node/role) -> value`` of one GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run_id", "node", "role")))
            out[s.name, labels] = s.value
    return out


class Stderr:
    """The agent's stderr, read by a thread (the pipe never fills), searchable while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.text += line

    def join(self) -> str:
        self._thread.join(timeout=10)
        return self.text


def test_a_standalone_job_through_a_crash_as_prometheus_sees_it(tmp_path: Path):
    agent = start("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--metrics-port=0",
                  f"--log-dir={tmp_path / 'logs'}", str(SCRIPTS / "metrics_worker.py"), str(tmp_path),
                  stdout=subprocess.DEVNULL)
    err = Stderr(agent)
    try:
        found = wait_for(lambda: URL.search(err.text), 60, what="the agent's 'metrics on' line")
        port = int(found.group(2))

        def restarted_and_stepping():
            m = scrape(port)
            again = m.get(("elaunch_restarts_total", (("cause", "failure"),))) == 1
            stepping = all(m.get(("elaunch_progress_step", (("local_rank", lr),)), 0) >= 3 for lr in "01")
            return m if again and stepping else None

        m = wait_for(restarted_and_stepping, 60, interval=0.2, what="a restart, then both ranks stepping")
        assert m["elaunch_rendezvous_rounds_total", ()] == 2
        assert m["elaunch_rendezvous_duration_seconds_count", ()] == 2
        assert m["elaunch_restarts_total", (("cause", "membership"),)] == 0
        assert m["elaunch_node_losses_total", ()] == 0
        workers = {state: m["elaunch_workers", (("state", state),)] for state in ("running", "succeeded", "failed",
                                                                                  "stopped")}
        assert workers == {"running": 2, "succeeded": 0, "failed": 0, "stopped": 0}
        for lr in "01":
            assert 0 <= m["elaunch_progress_age_seconds", (("local_rank", lr),)] < 5
        productive = m["elaunch_ledger_seconds_total", (("category", "productive"),)]
        assert productive > 0 and 0 < m["elaunch_goodput_ratio", ()] < 1
        (tmp_path / "stop").touch()
        assert agent.wait(timeout=60) == 0, err.join()
    finally:
        kill_tree(agent.pid)
    assert not port_open(port), "the metrics server outlived its agent"
    assert len(URL.findall(err.join())) == 1


def test_a_metrics_port_in_use_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", f"--metrics-port={port}",
                               f"--log-dir={tmp_path / 'logs'}", str(script)], capture_output=True, text=True,
                              env=launcher_env(), timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == [f"elaunch: error: --metrics-port={port}: cannot listen on 0.0.0.0:{port}: Address already in use"]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "logs").exists()


def test_a_local_addr_not_of_this_host_is_one_line_and_exit_2(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must never run')\n")
    proc = subprocess.run([sys.executable, "-m", "elaunch", "--standalone", "--metrics-port=0",
                           "--local-addr=192.0.2.1", str(script)], capture_output=True, text=True,
                          env=launcher_env(), timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == ["elaunch: error: --metrics-port=0: cannot listen on 192.0.2.1:0: Cannot assign requested address"]


IN_PROCESS = """
import logging, socket, sys
from elaunch import run as R

ports = []
class Catch(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("metrics on "):
            ports.append(int(record.getMessage().split(":")[2].split("/")[0]))
logging.getLogger("elaunch.agent").addHandler(Catch())
R.run(R.parse_args(["--standalone", "--nproc-per-node=1", "--metrics-port=0", sys.argv[1]]))
with socket.socket() as s:
    print(len(ports), "closed" if s.connect_ex(("127.0.0.1", ports[0])) != 0 else "open")
"""


def test_under_elaunch_run_the_server_closes_when_the_run_returns(tmp_path: Path):
    """The Python API runs the agent inside the caller's process: the port must not outlive the run."""
    script = tmp_path / "train.py"
    script.write_text("import elaunch\nelaunch.progress(step=1)\n")
    proc = subprocess.run([sys.executable, "-c", IN_PROCESS, str(script)], capture_output=True, text=True,
                          env=launcher_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "closed"], proc.stdout


@pytest.mark.parametrize("addr", [None, "127.0.0.1"], ids=["every-interface", "local-addr"])
def test_close_ends_the_server_loop_frees_the_port_and_leaves_no_thread(addr):
    """``AgentMetrics.close()`` wakes the server's loop (which looks for its stop flag only every 0.5 s by
    itself), ends it, frees the port, and its own helper thread and the connections that woke the loop go too."""
    from elaunch.agent.metrics import AgentMetrics

    before = set(threading.enumerate())
    metrics = AgentMetrics("r", None, "default")
    _host, port = metrics.serve(0, addr)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200  # it serves
    loop = metrics._thread
    metrics.close()
    assert not loop.is_alive(), "the server's loop outlived close()"
    wait_for(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()], 10,
             what="close()'s threads to end")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "something still listens on the port"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server that takes the port next binds
        s.bind(("127.0.0.1", port))
    metrics.close()  # idempotent
