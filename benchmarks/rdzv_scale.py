"""Rendezvous scale: N simulated agents complete one c10d round; seconds and store ops per agent.

The orchestrator hosts one TCPStore and starts a few processes, each running
several agents as threads. Every agent builds its handler the way its launcher
does (elaunch: ``elaunch.rendezvous.registry.create_handler``; torchrun:
``torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler``), each
with its own store client wrapped in a :class:`CountingStore`. After all
handlers exist, the orchestrator says "go" and every agent calls
``next_rendezvous()`` once; a round's time is go -> the last agent's return, and
an agent's operations are the store calls it made until its own return
(heartbeats included, the workers' store the rank-0 agent hosts excluded).

Run by hand: ``python -m benchmarks.rdzv_scale worker --impl elaunch --port P
--n N --count K --run-id R --timeout T`` (the orchestrator does this).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.common import LAUNCHERS, REPO, Recorder, launcher_env, log_line

#: N agents run in min(MAX_PROCS, ceil(N / 32)) processes: each process costs a torch
#: import (seconds of CPU on this 2-core machine); many threads per process slow the
#: agents down on the GIL.
MAX_PROCS = 8


def _procs_for(n: int) -> int:
    return max(1, min(MAX_PROCS, -(-n // 32)))


def _counting_store_class():
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """A torch Store that forwards every call to ``inner`` and counts the calls."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.ops = 0
            self._lock = threading.Lock()

        def __getattr__(self, name):  # port, host, libuvBackend, ...: the inner store's
            if name == "inner":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def _count(self) -> None:
            with self._lock:
                self.ops += 1

        def set(self, key, value):
            self._count()
            return self.inner.set(key, value)

        def get(self, key):
            self._count()
            return self.inner.get(key)

        def add(self, key, value):
            self._count()
            return self.inner.add(key, value)

        def compare_set(self, key, expected, desired):
            self._count()
            return self.inner.compare_set(key, expected, desired)

        def delete_key(self, key):
            self._count()
            return self.inner.delete_key(key)

        def check(self, keys):
            self._count()
            return self.inner.check(keys)

        def wait(self, keys, *timeout):
            self._count()
            return self.inner.wait(keys, *timeout)

        def num_keys(self):
            self._count()
            return self.inner.num_keys()

        def multi_get(self, keys):
            self._count()
            return self.inner.multi_get(keys)

        def multi_set(self, keys, values):
            self._count()
            return self.inner.multi_set(keys, values)

        def append(self, key, value):
            self._count()
            return self.inner.append(key, value)

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

    return CountingStore


def _make_handlers(impl: str, port: int, n: int, count: int, run_id: str, timeout: float):
    """Build ``count`` handlers of ``impl`` in parallel; returns ``[(handler, counting_store)]``.

    In parallel because connecting a TCPStore client now and then stalls for 5 s
    (about every 25th connection on this machine, with either server backend).
    """
    from concurrent.futures import ThreadPoolExecutor

    CountingStore = _counting_store_class()
    local = threading.local()

    def wrap(real_cls):
        def factory(*args, **kwargs):
            store = real_cls(*args, **kwargs)
            if kwargs.get("is_master") or (len(args) > 2 and args[2]):
                return store  # a store this agent hosts (the workers' store): not a client op
            local.last = CountingStore(store)
            return local.last
        return factory

    endpoint = f"127.0.0.1:{port}"
    if impl == "elaunch":
        import elaunch.rendezvous.c10d as c10d
        from elaunch.rendezvous.api import RendezvousParameters
        from elaunch.rendezvous.registry import create_handler

        c10d.TCPStore = wrap(c10d.TCPStore)

        def make():
            params = RendezvousParameters("c10d", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                          config={"is_host": "false", "join_timeout": str(timeout)})
            return create_handler(params), local.last
    else:
        import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as tb
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        tb.TCPStore = wrap(tb.TCPStore)

        def make():
            params = RendezvousParameters("c10d", endpoint, run_id, n, n, local_addr="127.0.0.1",
                                          is_host=False, join_timeout=timeout)
            return get_rendezvous_handler(params), local.last

    with ThreadPoolExecutor(max_workers=min(count, 128)) as pool:
        return list(pool.map(lambda _: make(), range(count)))


def worker_main(argv: list[str]) -> None:
    """One process of simulated agents: build, wait for GO on stdin, join, print JSON, exit."""
    p = argparse.ArgumentParser(prog="benchmarks.rdzv_scale worker")
    p.add_argument("--impl", choices=LAUNCHERS, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--timeout", type=float, required=True)
    a = p.parse_args(argv)
    handlers = _make_handlers(a.impl, a.port, a.n, a.count, a.run_id, a.timeout)
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    if not line or line[0] != "GO":
        os._exit(3)
    results: list[dict[str, Any]] = [{} for _ in handlers]

    def join(i: int, handler: Any, store: Any) -> None:
        try:
            handler.next_rendezvous()
            results[i] = {"t": time.time(), "ops": store.ops, "err": None}
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
            results[i] = {"t": time.time(), "ops": store.ops, "err": f"{type(exc).__name__}: {exc}"[:300]}

    threads = [threading.Thread(target=join, args=(i, h, s), daemon=True) for i, (h, s) in enumerate(handlers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + a.timeout + 5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for r in results:
        if not r:
            r.update({"t": None, "ops": None, "err": "timeout"})
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip shutdown: closing 100s of handlers would only add noise


def one_round(impl: str, n: int, timeout: float) -> dict[str, Any]:
    """Run one round of ``n`` agents of ``impl``.

    Returns:
        ``{"seconds": float | None, "ops": [per-agent ops], "error": str | None}``;
        seconds is None when the round did not complete within ``timeout`` seconds.
    """
    import datetime

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=timeout + 30), use_libuv=True)
    nproc = _procs_for(n)
    counts = [n // nproc + (1 if i < n % nproc else 0) for i in range(nproc)]
    run_id = f"bench-scale-{impl}-{n}-{os.getpid()}-{time.time_ns()}"
    procs: list[subprocess.Popen] = []
    # a bound on the whole round, so a stuck worker process cannot hang the benchmark
    watchdog = threading.Timer(timeout + 180, lambda: [p.kill() for p in list(procs)])
    watchdog.daemon = True
    watchdog.start()
    try:
        for c in counts:
            cmd = [sys.executable, "-m", "benchmarks.rdzv_scale", "worker", "--impl", impl, "--port",
                   str(server.port), "--n", str(n), "--count", str(c), "--run-id", run_id, "--timeout", str(timeout)]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True, env=launcher_env(), cwd=str(REPO)))
        for p in procs:
            if p.stdout.readline().strip() != "READY":  # blocks until the handlers exist
                return {"seconds": None, "ops": [], "error": "a worker process failed to build its handlers"}
        go = time.time()
        log_line(f"rdzv_scale: {impl} N={n}: {nproc} processes ready, go")
        for p in procs:
            p.stdin.write(f"GO {go}\n")
            p.stdin.flush()
        agents: list[dict[str, Any]] = []
        for p in procs:
            line = p.stdout.readline()
            agents += json.loads(line) if line.strip() else [{"t": None, "ops": None, "err": "no output"}]
    finally:
        watchdog.cancel()
        for p in procs:
            p.kill()
            p.wait()
        del server
    errors = sorted({a["err"] for a in agents if a["err"]})
    if errors:
        timed_out = all(e == "timeout" or e.startswith("RendezvousTimeoutError") for e in errors)
        first = errors[0].splitlines()[0][:80]
        return {"seconds": None, "ops": [a["ops"] for a in agents if a["ops"] is not None],
                "error": f"did not complete in {timeout:g} s" if timed_out else first}
    return {"seconds": max(a["t"] for a in agents) - go, "ops": [a["ops"] for a in agents], "error": None}


def bench_rdzv_scale(sizes: tuple[int, ...], timeout: float) -> Recorder:
    """N agents, one c10d round, per N and launcher; once a launcher misses ``timeout`` s, larger N are skipped."""
    import statistics

    rec = Recorder("rdzv_scale")
    given_up: dict[str, str] = {}
    smallest, largest = min(sizes), max(sizes)
    for n in sorted(sizes):
        target_s = {"kind": "abs_le", "value": 10.0, "text": "<= 10 s"} if n == 1024 else None
        target_ops = ({"kind": "flat", "value": 1.5, "base": f"rdzv_scale.ops_{smallest}",
                       "text": f"independent of N (<= 1.5x N={smallest})"} if n == largest and n != smallest else None)
        rec.metric(f"seconds_{n}", f"rendezvous scale (c10d): {n} agents, one round", "s", target_s)
        rec.metric(f"ops_{n}", f"rendezvous scale (c10d): store ops per agent, N={n} (median)", "ops", target_ops)
        rec.metric(f"ops_max_{n}", f"rendezvous scale (c10d): store ops per agent, N={n} (max)", "ops")
        for impl in LAUNCHERS:
            if impl in given_up:
                for k in ("seconds", "ops", "ops_max"):
                    rec.add(f"{k}_{n}", impl, None, given_up[impl])
                continue
            log_line(f"rdzv_scale: {impl} N={n}")
            r = one_round(impl, n, timeout)
            if r["error"]:
                log_line(f"rdzv_scale: {impl} N={n}: {r['error']}")
                given_up[impl] = f"skipped (N={n} did not complete)"
            elif r["seconds"] > timeout / 3:  # rounds grow at least linearly with N
                given_up[impl] = f"skipped (N={n} already took {r['seconds']:.0f} s)"
            ops = r["ops"]
            rec.add(f"seconds_{n}", impl, r["seconds"], r["error"])
            rec.add(f"ops_{n}", impl, statistics.median(ops) if ops and not r["error"] else None, r["error"])
            rec.add(f"ops_max_{n}", impl, max(ops) if ops and not r["error"] else None, r["error"])
    return rec


def etcd_note() -> str | None:
    """Return why the etcd variant is skipped, or None when it can run."""
    from elaunch.rendezvous.api import RendezvousConfigError, RendezvousParameters
    from elaunch.rendezvous.registry import create_handler

    try:
        create_handler(RendezvousParameters("etcd-v2", "127.0.0.1:1", "probe", 1, 1))
    except RendezvousConfigError as exc:
        if "not available" in str(exc):
            return "etcd: skipped (elaunch has no etcd backend yet)"
    except Exception:  # noqa: BLE001 - any other error means the backend exists
        pass
    if shutil.which("etcd") is None:
        return "etcd: skipped (no etcd server binary on PATH)"
    return "etcd: skipped (the etcd variant of this scenario is not written yet)"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m benchmarks.rdzv_scale worker ... (started by benchmarks.run)")
