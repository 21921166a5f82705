"""The test Prometheus (tests/prometheus_server.py) scrapes what it is pointed at and answers queries.

A ``prometheus_client`` exporter in this process is the target: its counter, set here,
must come back through Prometheus' HTTP API within a few scrape intervals.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from tests.conftest import wait_for
from tests.prometheus_server import PrometheusError


def test_scrapes_a_target_and_answers_an_instant_query(prometheus):
    registry = CollectorRegistry()
    counter = Counter("fixture_probe_events", "events seen by the probe", ["kind"], registry=registry)
    counter.labels(kind="crash").inc(3)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        target = f"127.0.0.1:{server.server_port}"
        prom = prometheus([target])
        prom.wait_scraped(timeout=20)
        assert wait_for(lambda: prom.value('fixture_probe_events_total{kind="crash"}') == 3.0, 10,
                        what="the counter scraped") is True
        series = prom.query("fixture_probe_events_total")
        assert [s["metric"]["instance"] for s in series] == [target]
        counter.labels(kind="crash").inc()
        wait_for(lambda: prom.value('fixture_probe_events_total{kind="crash"}') == 4.0, 10,
                 what="the next scrape's value")
        with pytest.raises(PrometheusError, match="parse"):
            prom.query("sum(")
    finally:
        server.shutdown()
        thread.join(5)
    proc = prom.proc
    prom.stop()
    assert prom.proc is None and proc.returncode is not None  # reaped
