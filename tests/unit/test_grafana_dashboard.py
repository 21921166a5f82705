"""The Grafana dashboard (examples/grafana/elaunch-dashboard.json) asks only for what the agents serve.

Every PromQL expression in it (panel targets and template variables) may name only
the metrics and labels of the issue 25 list, a histogram only through its
``_bucket``/``_sum``/``_count`` series, and that list must be exactly what an agent's
collector (``elaunch.agent.metrics``) exports once every metric has a value; each expression
must parse (``promtool check rules``, Grafana's ``$__range``-style variables
replaced by what Grafana sends); and the panels must be a dashboard Grafana loads:
unique ids, all on the 24-column grid without overlapping, every query on the
dashboard's data source variable.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elaunch.agent.metrics import AgentMetrics
from elaunch.checkpoint.keeper import NodeSnapshot as Snapshot
from tests.conftest import REPO
from tests.prometheus_server import promtool_binary

DASHBOARD = REPO / "examples" / "grafana" / "elaunch-dashboard.json"

#: The metrics an agent serves (docs/metrics.md; names agreed in issue 25), by type.
COUNTERS = ("elaunch_restarts_total", "elaunch_rendezvous_rounds_total", "elaunch_membership_changes_total",
            "elaunch_node_losses_total", "elaunch_hang_verdicts_total", "elaunch_ledger_seconds_total",
            "elaunch_inprocess_restarts_total")
HISTOGRAMS = ("elaunch_rendezvous_duration_seconds",)
GAUGES = ("elaunch_workers", "elaunch_progress_age_seconds", "elaunch_progress_step", "elaunch_snapshot_step",
          "elaunch_snapshot_age_seconds", "elaunch_snapshot_persist_lag_seconds", "elaunch_goodput_ratio")
#: Series names a query may use: a histogram is queried through its three series.
SERIES = frozenset(COUNTERS + GAUGES + tuple(f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")))
#: The metrics' labels, the histogram's ``le``, and what Prometheus adds to every scraped series.
LABELS = frozenset({"run_id", "node", "role", "local_rank", "cause", "state", "category", "le", "instance", "job"})

#: PromQL words that are not metric names (set operators, modifiers, grouping).
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                      "group_left", "group_right", "inf", "nan"})
#: What Grafana puts in place of its variables before the query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "6h", "$run_id": ".*", "$node": ".*"}


def _load() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def expressions(dash: dict) -> list[str]:
    """Every PromQL expression: panel targets, and the selectors inside template ``label_values(...)``."""
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
            assert m, f"template variable {var['name']}: not label_values(SELECTOR, LABEL): {q}"
            exprs.append(f'count by ({m.group(2)}) ({m.group(1)})')
    return exprs


def grafana_expanded(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and label names a PromQL expression uses.

    Label names come from matchers (``{a="x"}``) and grouping clauses (``by (a)``,
    ``on (a)``, ...); metric names are the identifiers left that are not a function
    call, a keyword or inside a string.
    """
    labels: set[str] = set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', grafana_expanded(expr))  # string literals
    for block in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", block))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels.update(x.strip() for x in clause.split(",") if x.strip())
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:ms|[smhdwy])*\b", " ", text)  # numbers, durations
    metrics = {m.group(1) for m in re.finditer(r"([A-Za-z_:][\w:]*)(\s*\()?", text)
               if not m.group(2) and m.group(1).lower() not in KEYWORDS}
    return metrics, labels


@pytest.mark.parametrize("expr, metrics, labels", [
    ('sum by (cause) (increase(elaunch_restarts_total{run_id=~"$run_id"}[$__rate_interval]))',
     {"elaunch_restarts_total"}, {"cause", "run_id"}),
    ('histogram_quantile(0.99, sum by (le) (rate(x_bucket{node!="a{b}"}[15m])))', {"x_bucket"}, {"le", "node"}),
    ("a / on (node) group_left (role) b offset 5m", {"a", "b"}, {"node", "role"}),
    ('sum without (instance) (c{category="stopped"}) > bool 0.5e3', {"c"}, {"instance", "category"}),
])
def test_names_in_reads_promql(expr, metrics, labels):
    assert names_in(expr) == (metrics, labels)


def test_every_query_names_only_the_metrics_and_labels_the_agents_serve():
    exprs = expressions(_load())
    assert len(exprs) >= 10
    used: set[str] = set()
    for expr in exprs:
        metrics, labels = names_in(expr)
        assert metrics, f"no metric in {expr}"
        assert metrics <= SERIES, f"not a metric an agent serves: {sorted(metrics - SERIES)} in {expr}"
        assert labels <= LABELS, f"not a label of the metrics: {sorted(labels - LABELS)} in {expr}"
        used |= metrics
    # the four: goodput, restarts, round durations, progress age per rank
    assert {"elaunch_goodput_ratio", "elaunch_ledger_seconds_total", "elaunch_restarts_total",
            "elaunch_rendezvous_duration_seconds_bucket", "elaunch_progress_age_seconds"} <= used


def exported() -> tuple[set[str], set[str]]:
    """Series and label names an agent's ``/metrics`` has once every metric has a value.

    The real collector (``elaunch.agent.metrics.AgentMetrics``) fed a round, a started group
    with progress, and a snapshot; no server: the text is what ``/metrics`` serves.
    """
    m = AgentMetrics("job", "n1", "trainer", clock=lambda: 20.0, progress=lambda: {0: (0.5, 7), 1: (0.4, 7)},
                     snapshot=lambda: Snapshot(step=6, time=18.0, persisted_time=15.0))
    base = {"node": "n1", "host": "h", "round": 0}
    for e in ({"time": 1.0, "kind": "rendezvous_join"}, {"time": 2.0, "kind": "rendezvous_complete", "seconds": 1.0},
              {"time": 3.0, "kind": "workers_started", "local_ranks": [0, 1]}, {"time": 4.0, "kind": "training"}):
        m.observe({**base, **e})
    series, labels = set(), set()
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for sample in fam.samples:
            series.add(sample.name)
            labels.update(sample.labels)
    return series - {s for s in series if s.endswith("_created")}, labels


def test_the_list_is_what_an_agent_exports():
    series, labels = exported()
    assert series == SERIES
    assert labels | {"instance", "job"} == LABELS


def test_every_query_parses(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool is not installed (scripts/install-prometheus.sh installs it with prometheus)")
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_expanded(e)} for i, e in enumerate(expressions(_load()))]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout


def test_it_is_a_dashboard_grafana_loads():
    dash = _load()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names[0] == "datasource" and {"run_id", "node"} <= set(names)
