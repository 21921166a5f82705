"""A real Prometheus scrapes two agents of a c10d job through a worker crash and a node loss (issue 25).

Two agents of ``--nnodes=1:2`` on loopback serve ``--metrics-port``; a Prometheus
(tests/prometheus_server.py, Debian's 2.42) scrapes both every second. The job's
global rank 1 exits 3 once (a counted restart on both nodes, cause ``failure``);
then the agent that does not host the c10d store is SIGKILLed with its workers
(a node lost), and the survivor goes on alone. Through Prometheus' HTTP API only:

- each node's ``elaunch_restarts_total{cause="failure"}`` is 1 after the crash;
- the survivor's ``elaunch_node_losses_total`` is 1 and its failure restarts still 1;
- its ``elaunch_goodput_ratio`` is below 1 and matches the ledger of its own
  ``events.jsonl`` (``elaunch.agent.ledger.ledger_of``) at the scrape's timestamp,
  to within what the ledger moves in one scrape interval; so does each
  ``elaunch_ledger_seconds_total{category}``.

Each agent's ``/metrics`` also passes ``promtool check metrics``.
"""

from __future__ import annotations

import glob
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from elaunch.agent.ledger import CATEGORIES, ledger_of
from tests.conftest import wait_for
from tests.helpers import SCRIPTS, free_port, kill_tree, start
from tests.prometheus_server import PrometheusServer, promtool_binary

pytestmark = pytest.mark.slow

WORKER = str(SCRIPTS / "metrics_job.py")
CRASH_AT, RESUME_AT = 10, 4
INTERVAL = 1.0  # the fixture's scrape interval, seconds


def _events(log_dir: Path) -> list[dict]:
    paths = glob.glob(str(log_dir / "*" / "events.jsonl"))
    if not paths:
        return []
    (path,) = paths
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left out


def _kinds(events: list[dict], kind: str, **fields) -> list[dict]:
    return [e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items())]


def _listens_on(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


def _ledger_at(events: list[dict], t: float) -> dict:
    return ledger_of([e for e in events if e["time"] <= t], now=t)


def _matches_ledger(prom: PrometheusServer, instance: str, log_dir: Path) -> tuple[float, float]:
    """Goodput and ledger seconds as Prometheus has them, against the event log's ledger at the sample's time.

    The sample used is one scraped after this call began, and the events are read after
    the queries: every event the agent had folded when it was scraped is in the file by
    then. (A ``training`` line is written with the time of the first ``progress()``, which
    can be before it is written: a sample scraped in between would differ from the file.)

    Returns:
        (goodput, sample timestamp).
    """
    sel = f'{{instance="{instance}"}}'
    begun = time.time()
    wait_for(lambda: (prom.value(f"timestamp(elaunch_goodput_ratio{sel})") or 0) > begun + 0.05, 15,
             interval=0.2, what="a scrape after the check began")
    at = prom.value("time()")  # one evaluation time for every query below
    goodput = prom.value(f"elaunch_goodput_ratio{sel}", at)
    ts = prom.value(f"timestamp(elaunch_goodput_ratio{sel})", at)
    shown = {cat: prom.value(f'elaunch_ledger_seconds_total{{instance="{instance}", category="{cat}"}}', at)
             for cat in CATEGORIES}
    events = _events(log_dir)
    ledger = _ledger_at(events, ts)
    # what the ledger moves in one scrape interval either side of the sample: the tolerance
    before, after = _ledger_at(events, ts - INTERVAL), _ledger_at(events, ts + INTERVAL)
    slack = max(abs(after["goodput"] - ledger["goodput"]), abs(before["goodput"] - ledger["goodput"]))
    assert abs(goodput - ledger["goodput"]) <= slack + 1e-6, (goodput, ledger, slack)
    for cat in CATEGORIES:
        assert shown[cat] is not None, cat
        assert abs(shown[cat] - ledger["seconds"][cat]) <= INTERVAL + 0.05, (cat, shown, ledger)
    return goodput, ts


def _wait_value(prom: PrometheusServer, expr: str, expected: float, what: str, more=lambda: "") -> None:
    """Wait (15 s) until ``expr`` has the single value ``expected``; else fail with what Prometheus had."""
    last: list = []

    def ok() -> bool:
        last[:] = prom.query(expr)
        return len(last) == 1 and last[0]["value"] == expected
    try:
        wait_for(ok, 15, interval=0.2, what=what)
    except AssertionError as e:
        targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in prom.active_targets()]
        raise AssertionError(f"{e}: {expr} = {last}\ntargets: {targets}\n{more()}") from None


def _promtool_check(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read()
    r = subprocess.run([promtool_binary(), "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0, (r.stdout + r.stderr).decode(errors="replace") + body.decode()[:3000]


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
def test_prometheus_sees_one_restart_one_node_loss_and_the_ledgers_goodput(prometheus, tmp_path):
    rdzv_port = free_port()
    ports = [free_port(), free_port()]
    instances = [f"127.0.0.1:{p}" for p in ports]
    prom = prometheus(instances)  # started first: its first scrape comes ~5 s after it starts
    logs = [tmp_path / "log0", tmp_path / "log1"]
    errs = [tmp_path / "agent0.err", tmp_path / "agent1.err"]
    agents: list[subprocess.Popen] = []

    def stderr() -> str:
        return "".join(f"--- {e.name} ---\n{e.read_text(errors='replace')[-3000:]}\n" for e in errs if e.exists())

    def alive() -> bool:
        return all(a.poll() is None for a in agents)

    try:
        for i in (0, 1):  # started together: the first round's last call (3 s) waits for the second
            with open(errs[i], "w") as err:
                agents.append(start(
                    "elaunch", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-id=prom-job",
                    "--rdzv-conf=last_call_timeout=3,join_timeout=60", "--local-addr=127.0.0.1",
                    "--monitor-interval=0.1", "--max-restarts=3", f"--metrics-port={ports[i]}",
                    f"--log-dir={logs[i]}", WORKER, str(tmp_path), str(CRASH_AT), str(RESUME_AT),
                    stdout=subprocess.DEVNULL, stderr=err))

        # the crash: a counted restart on both nodes, and both groups training again
        def restarted(i: int) -> bool:
            ev = _events(logs[i])
            return bool(_kinds(ev, "restart", cause="failure")) and len(_kinds(ev, "training")) >= 2
        try:
            wait_for(lambda: (restarted(0) and restarted(1)) or not alive(), 90, what="the restart after the crash")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{[_events(d) for d in logs]}\n{stderr()}") from None
        assert alive(), stderr()
        for inst in instances:
            _wait_value(prom, f'elaunch_restarts_total{{instance="{inst}", cause="failure"}}', 1,
                        f"Prometheus: one failure restart on {inst}", stderr)
        for port in ports:
            _promtool_check(port)

        # the node loss: the agent not hosting the c10d store SIGKILLed with its workers; the other goes on alone
        s = next((i for i in (0, 1) if _listens_on(agents[i].pid, rdzv_port)), None)
        assert s is not None, "neither agent hosts the c10d store"
        v = 1 - s
        lost = _events(logs[v])[0]["node"]
        kill_tree(agents[v].pid)
        agents[v].wait(10)

        def reformed() -> bool:
            ev = _events(logs[s])
            changes = [e for e in ev if e["kind"] == "membership_change" and lost in (e.get("left") or ())]
            return bool(changes) and any(e["kind"] == "training" and e["time"] > changes[-1]["time"] for e in ev)
        try:
            wait_for(lambda: reformed() or agents[s].poll() is not None, 60, what="the survivor training alone")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_events(logs[s])}\n{stderr()}") from None
        assert agents[s].poll() is None, stderr()
        survivor = instances[s]
        _wait_value(prom, f'elaunch_node_losses_total{{instance="{survivor}"}}', 1,
                    "Prometheus: one node loss on the survivor", stderr)
        assert prom.value(f'elaunch_restarts_total{{instance="{survivor}", cause="failure"}}') == 1
        _wait_value(prom, f'up{{instance="{instances[v]}"}}', 0, "the lost agent's target down")

        goodput, _ts = _matches_ledger(prom, survivor, logs[s])
        assert 0 < goodput < 1
        _promtool_check(ports[s])

        (tmp_path / "stop").touch()
        assert agents[s].wait(timeout=60) == 0, stderr()
    finally:
        for a in agents:
            kill_tree(a.pid)
