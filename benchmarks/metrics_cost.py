"""What ``--metrics-port`` costs an idle agent, and how fast a scrape is answered (issue 25).

Scenario ``overhead_metrics``, beside ``overhead`` (benchmarks/scenarios.py): the same
two sleeping workers under ``--standalone`` over a longer window (``WINDOW``), elaunch now
with ``--metrics-port`` and scraped once a second from this process (Prometheus' shortest usual interval; a
server nobody scrapes costs nothing to measure). torchrun has no metrics server: its
row is its plain idle CPU, measured in the same run, interleaved, so the ratio is
elaunch-with-metrics over torchrun as it is (target <= 0.5x, as the plain row).

After the window, while the workers still sleep, ``SCRAPES`` (``SCRAPES_QUICK``) GETs of
``/metrics``, one after the other with a short pause, each on a new connection as
Prometheus makes them after an idle interval; the time of each is from the
connect to the last byte of the body. The rows are the median (p50) and the
nearest-rank 99th percentile (p99), target <= 10 ms.
"""

from __future__ import annotations

import http.client
import math
import time
from pathlib import Path

from benchmarks.common import DidNotComplete, Recorder, free_port
from benchmarks.scenarios import BenchConfig, _drive, idle_window

#: Scrapes timed per repeat for the latency rows (full, quick).
SCRAPES, SCRAPES_QUICK = 200, 40
#: Seconds of the idle window in full mode (quick: the overhead row's). CPU times come in clock
#: ticks (10 ms): over the overhead row's 15 s a tick is 0.04 s/min, half the target here
#: (torchrun idles at ~0.16 s/min), so the window is longer: a tick is 0.01 s/min.
WINDOW = 60.0
#: Seconds between two timed scrapes.
PAUSE = 0.005


def scrape(port: int, timeout: float = 5.0) -> tuple[float, bytes]:
    """GET ``http://127.0.0.1:port/metrics`` on a new connection; return (seconds, body).

    Raises:
        DidNotComplete: no 200 answer (refused, reset, timed out, another status).
    """
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
    except OSError as exc:
        raise DidNotComplete(f"GET /metrics on port {port}: {exc}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise DidNotComplete(f"GET /metrics on port {port}: HTTP {resp.status}")
    return time.perf_counter() - t0, body


def nearest_rank(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``samples`` by the nearest-rank method (a sample itself)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bench_overhead_metrics(cfg: BenchConfig) -> Recorder:
    """Idle CPU with ``--metrics-port`` on, scraped every second and every 15 s; scrape latency p50/p99."""
    rec = Recorder("overhead_metrics")
    rec.metric("cpu_per_min", "agent overhead with --metrics-port, scraped every 1 s: launcher CPU per minute, "
               "2 sleeping workers (torchrun: no metrics server)", "s/min",
               {"kind": "ratio_le", "value": 0.5, "text": "<= 0.5x torchrun"})
    rec.metric("cpu_per_min_15s", "agent overhead with --metrics-port, scraped every 15 s (the interval of "
               "docs/metrics.md's and docs/slurm.md's Prometheus settings): launcher CPU per minute, 2 sleeping "
               "workers (torchrun: no metrics server)", "s/min",
               {"kind": "ratio_le", "value": 0.5, "text": "<= 0.5x torchrun"})
    rec.metric("scrape_p50", "GET /metrics on an idle agent (2 workers): p50", "ms",
               {"kind": "abs_le", "value": 10.0, "text": "<= 10 ms"})
    rec.metric("scrape_p99", "GET /metrics on an idle agent (2 workers): p99", "ms",
               {"kind": "abs_le", "value": 10.0, "text": "<= 10 ms"})
    count = SCRAPES_QUICK if cfg.quick else SCRAPES
    window = cfg.overhead_seconds if cfg.quick else WINDOW

    def once(which: str, log: Path, out: Path) -> dict[str, float]:
        if which != "elaunch":
            for row in ("scrape_p50", "scrape_p99"):
                rec.add(row, which, None, f"{which} serves no /metrics")
            plain = idle_window(cfg, which, log, window=window)["cpu_per_min"]
            return {"cpu_per_min": plain, "cpu_per_min_15s": plain}
        port = free_port()
        last = [0.0]

        def every(interval: float):
            def tick() -> None:
                if time.monotonic() - last[0] >= interval:
                    last[0] = time.monotonic()
                    scrape(port)
            return tick

        every_second = every(1.0)

        def timed() -> dict[str, float]:
            seconds = []
            for _ in range(count):
                seconds.append(scrape(port)[0])
                time.sleep(PAUSE)
            return {"scrape_p50": nearest_rank(seconds, 0.5) * 1000, "scrape_p99": nearest_rank(seconds, 0.99) * 1000}

        values = idle_window(cfg, which, log, (f"--metrics-port={port}",), tick=every_second, before_exit=timed,
                             before_exit_seconds=count * (PAUSE + 0.05), window=window)
        last[0] = 0.0
        slow = idle_window(cfg, which, log, (f"--metrics-port={port}",), tick=every(15.0), window=window)
        return {**{k: values[k] for k in ("cpu_per_min", "scrape_p50", "scrape_p99")},
                "cpu_per_min_15s": slow["cpu_per_min"]}

    return _drive(cfg, rec, "overhead_metrics", once)
