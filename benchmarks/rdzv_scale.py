"""Rendezvous scale: N simulated agents complete one rendezvous round; seconds and server ops per agent.

Two variants, each elaunch and torchrun side by side:

* **c10d** (keys ``seconds_{n}``, ``ops_{n}``, ``ops_max_{n}``): the orchestrator
  hosts one TCPStore; both launchers use their ``c10d`` backend. An agent's
  operations are the calls on its store client (a :class:`CountingStore`): every
  ``set``/``get``/``add``/``compare_set``/``delete_key``/``check``/``wait``/
  ``num_keys``/``multi_get``/``multi_set``/``append``; the workers' store the
  rank-0 agent hosts is not counted.
* **etcd** (keys ``etcd_seconds_{n}``, ``etcd_ops_{n}``, ``etcd_ops_max_{n}``):
  the orchestrator starts a real etcd server for each round (``etcd --enable-v2``,
  free loopback ports, a temp data dir; stopped and removed after the round), as
  the c10d variant hosts a TCPStore for each round. elaunch uses its ``etcd-v3`` backend (gRPC, etcd-sdk-python), torchrun
  torch's ``etcd-v2`` backend (HTTP, python-etcd). Sizes are those of c10d capped
  at :data:`ETCD_MAX_N`. What counts as one operation:

  - elaunch: one call of a method of the etcd-sdk-python client
    (``MultiEndpointEtcd3Client``) that talks to the server, on every client
    (first one and reconnections) of the agent's two ``EtcdV3KV`` objects (the
    rendezvous' and the presence lease's): every public method except
    ``close``/``get_watcher``/``get_secure_creds``, in practice ``get``,
    ``transaction``, ``put``, ``lease`` (LeaseGrant), ``refresh_lease`` (one
    LeaseKeepAlive exchange), ``revoke_lease``, ``add_watch_callback`` /
    ``add_watch_prefix_callback`` (a watch-create request on the client's watch
    stream) and ``cancel_watch`` (a watch-cancel request). Events that arrive on
    an open watch stream are not requests and are not counted; a retried call
    counts once per attempt.
  - torchrun: one HTTP request of the agent's ``etcd.Client`` (every call of
    ``request``/``request_encode_body``/``request_encode_url``/``urlopen`` on its
    urllib3 pool): the ``/v2/machines`` lookup of the client's constructor, the
    rendezvous state's reads and compare-and-set writes, the ``EtcdStore``'s
    reads, writes and long-poll watches (``wait=true``, one request each) that
    publish MASTER_ADDR/PORT, and the heartbeats; retries count once each.

How a round runs (both variants): the orchestrator starts a few processes, each
running several agents as threads. Every agent builds its handler the way its
launcher does (elaunch: ``elaunch.rendezvous.registry.create_handler``; torchrun:
``torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler``), each
with its own client(s), counted per agent. A process of elaunch agents then
freezes its start-up heap out of garbage collection, as the ``elaunch``
command's agent does before its first rendezvous (``elaunch.agent.heap``);
torchrun's agent does not, nor do its simulating processes. Every simulating process,
of both launchers, then turns the cyclic collector off (``COLLECTOR_OFF``: its agents
share one heap, which an agent on its own host does not). After all handlers exist, the
orchestrator says "go" and every agent calls ``next_rendezvous()`` once; a round's
time is go -> the last agent's return, and an agent's operations are those it made
from the creation of its handler until its own ``next_rendezvous()`` returned
(handler construction, heartbeats and lease keep-alives in that span included).

The restart variant (c10d, keys ``restart_*``) times what a job restart costs the
rendezvous: after such a first round has completed for all N agents, the
orchestrator says "go" again and every agent calls ``next_rendezvous()`` a second
time (it leaves the running round and joins the next, as an agent does after a
worker failure); its time and operations are that second call's only.

Run by hand: ``python -m benchmarks.rdzv_scale worker --impl elaunch --backend c10d
--endpoint HOST:PORT --n N --count K --run-id R --timeout T`` (the orchestrator does this).
"""

from __future__ import annotations

import argparse
import gc
import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from benchmarks.common import LAUNCHERS, REPO, Recorder, launcher_env, log_line
from benchmarks.etcd_server import EtcdServer, etcd_binary, missing_for_etcd

#: N agents run in min(MAX_PROCS, ceil(N / 32)) processes: each process costs a torch
#: import (seconds of CPU on this 2-core machine); many threads per process slow the
#: agents down on the GIL.
MAX_PROCS = 8
#: Seconds of CPython's switch interval in a simulating process (default 0.005). Each of
#: up to 128 agent threads waiting for the GIL wakes every interval to ask for it: at the
#: default, on this machine's kernel, those wake-ups alone kept both cores ~80% in the
#: kernel (futex waits, 150k context switches/s) and a 1024-agent c10d round took 40-64 s
#: instead of ~4. Separate hosts have no shared GIL; a longer interval only delays the
#: preemption of a thread that runs Python without blocking (a thread that blocks on I/O
#: hands the GIL over at once). Same for both launchers.
SWITCH_INTERVAL = 0.25
#: The cyclic garbage collector is off in a simulating process from just before "go" to its report
#: (``gc.disable()``, since 2026-11-27 session 13, both launchers). 128 agents share one
#: heap there: every collection walks all 128 agents' objects and is triggered by all
#: their allocations, so its cost grows with the square of the agents per process, where an
#: agent on its own host pays for its own heap only. Measured at N=1024 (etcd-v3, elaunch):
#: 0.8-1.2 s of collection per process in a ~9 s round (half of it full collections), of
#: the ~2 CPU-seconds per second the 8 processes had. The round is seconds long; its
#: garbage is freed at exit.
COLLECTOR_OFF = True
#: The etcd variant runs the c10d sizes up to this N. elaunch's simulated agents share one
#: gRPC channel per process and one of its WATCH_STREAMS watch streams (each agent with its
#: own client object, leases, watches and requests): with a channel and a watch thread per
#: agent (2048 clients at N=1024) not even elaunch's round completed within 30 s on 2 cores.
ETCD_MAX_N = 1024
#: Watch streams per simulating process (etcd-sdk-python's ``Watcher``: a stream and its
#: thread), its agents spread over them. A stream sets up one watch at a time, which a
#: host's agent never notices; 128 agents on one stream queued behind each other's
#: creates (the watches a round needs took seconds to open, and in some runs a create
#: timed out and the round did not complete). 16 keeps 8 agents per stream at N=1024.
WATCH_STREAMS = 16
#: The rendezvous backend each launcher uses in the etcd variant.
ETCD_BACKENDS = {"elaunch": "etcd-v3", "torchrun": "etcd-v2"}


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


class OpCounter:
    """The etcd requests of one agent (thread-safe: keep-alive and watch threads count too)."""

    def __init__(self) -> None:
        self.ops = 0
        self._lock = threading.Lock()

    def count(self) -> None:
        with self._lock:
            self.ops += 1


class CountingEtcd3Client:
    """Forwards to an etcd-sdk-python client; each call of a method that talks to etcd counts one op.

    Every public method counts except :attr:`NOT_RPC` (local only); attributes
    (``transactions``, ``call_credentials``, ...) are the inner client's, unwrapped.
    """

    NOT_RPC = frozenset({"close", "get_watcher", "get_secure_creds"})

    def __init__(self, inner: Any, counter: OpCounter) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_counter", counter)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("_") or name in self.NOT_RPC or not callable(value) or isinstance(value, type):
            return value
        return _counted(value, self._counter)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class CountingPool:
    """Forwards to a urllib3 PoolManager; each HTTP request through it counts one op."""

    REQUESTS = frozenset({"request", "request_encode_body", "request_encode_url", "urlopen"})

    def __init__(self, inner: Any, counter: OpCounter) -> None:
        self._inner = inner
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self.REQUESTS:
            return value
        return _counted(value, self._counter)


def _counted(fn: Any, counter: OpCounter) -> Any:
    """``fn``, counting one op per call."""
    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.count()
        return fn(*args, **kwargs)

    return counted


def _leave_shared_open() -> None:
    """``close`` of a simulated agent's etcd client: its channel and watch stream are shared, left open."""


def _make_etcd_handlers(impl: str, endpoint: str, n: int, count: int, run_id: str, timeout: float):
    """Build ``count`` etcd handlers of ``impl`` in parallel; returns ``[(handler, OpCounter)]``.

    The clients are counted by patching this (worker) process's client classes: the
    counter of the agent whose handler is being built is taken from a thread-local.
    """
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()
    if impl == "elaunch":
        import elaunch.rendezvous.etcd.v3 as ev3
        from elaunch.rendezvous.contract import RendezvousParameters
        from elaunch.rendezvous.registry import create_handler

        real_init, real_make_client = ev3.EtcdV3KV.__init__, ev3.EtcdV3KV._make_client
        shared: dict[tuple[str, int], Any] = {}  # (host, port) -> this process's one client
        streams: dict[tuple[str, int], list[Any]] = {}  # (host, port) -> its watch streams
        shared_lock = threading.Lock()

        def init(self, *args, **kwargs):  # the rendezvous' KV and the presence's KV of one agent
            real_init(self, *args, **kwargs)
            self._bench_counter = local.counter
            self._bench_agent = local.agent

        def make_client(self, host, port):  # every (re)connection of that KV
            with shared_lock:
                if (host, port) not in shared:
                    shared[(host, port)] = real_make_client(self, host, port)
                    streams[(host, port)] = [shared[(host, port)].watcher]
                first, watchers = shared[(host, port)], streams[(host, port)]
                while len(watchers) < WATCH_STREAMS:
                    watchers.append(first.get_watcher())  # on the one channel
            # the agent's own client object (its requests, leases and watch ids are its own)
            # and its own copies of the endpoints (pyetcd's failed mark, set by one request's
            # timeout, refuses every request for time_retry seconds: shared, one timeout failed
            # all of a process's agents), on the process's one gRPC channel and one of its watch streams,
            # as agents on separate hosts would each have their own
            client = ev3.import_client("pyetcd", "etcd-v3").MultiEndpointEtcd3Client(
                endpoints=[copy.copy(e) for e in first.endpoints.values()], timeout=first.timeout)
            client.call_credentials = None
            watcher = client.watcher = watchers[self._bench_agent % WATCH_STREAMS]

            def clear_stubs() -> None:
                # pyetcd calls this on a failed request (a timeout, say): it drops the stubs and
                # closes the client's watcher, here a stream 7 other agents watch on. Closed, their
                # standing watches broke; and close() blocks on the stream's full request queue
                # while holding its lock, so each of them then hung in its next call (a round of
                # 1024 did not complete: 64 agents stuck in close()). On separate hosts a failed
                # request closes only that agent's own stream: keep the shared one open.
                client._stubs.clear()
                client.watcher = watcher

            client._clear_old_stubs = clear_stubs
            # an agent drops (closes) its client on a transient error and makes a new one;
            # closing would close the shared channel and watch stream under every other agent
            # of this process ("Cannot invoke RPC on closed channel!"), which separate hosts
            # never see: the agent's close leaves them open (they live as long as the process)
            client.close = _leave_shared_open
            return CountingEtcd3Client(client, self._bench_counter)

        ev3.EtcdV3KV.__init__ = init
        ev3.EtcdV3KV._make_client = make_client

        def build():
            params = RendezvousParameters(ETCD_BACKENDS[impl], endpoint, run_id, n, n, local_addr="127.0.0.1",
                                          config={"join_timeout": str(timeout)})
            return create_handler(params)
    else:
        import etcd
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        class CountingClient(etcd.Client):
            """python-etcd's client whose urllib3 pool (``self.http``, set in ``__init__``) counts requests."""

            @property
            def http(self):
                return self.__dict__.get("_bench_http")

            @http.setter
            def http(self, pool):
                self.__dict__["_bench_http"] = CountingPool(pool, local.counter)

        etcd.Client = CountingClient  # torch's etcd_rendezvous_backend calls etcd.Client(...)

        def build():
            params = RendezvousParameters(ETCD_BACKENDS[impl], endpoint, run_id, n, n, local_addr="127.0.0.1",
                                          join_timeout=timeout)
            return get_rendezvous_handler(params)

    agents = itertools.count()

    def make():
        local.counter, local.agent = OpCounter(), next(agents)
        return build(), local.counter

    with ThreadPoolExecutor(max_workers=min(count, 128)) as pool:
        return list(pool.map(lambda _: make(), range(count)))


def _make_handlers(impl: str, endpoint: str, n: int, count: int, run_id: str, timeout: float):
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

    if impl == "elaunch":
        import torch.distributed as dist

        from elaunch.rendezvous.contract import RendezvousParameters
        from elaunch.rendezvous.registry import create_handler

        dist.TCPStore = wrap(dist.TCPStore)  # elaunch's c10d backend imports it where it makes a store

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
    p.add_argument("--backend", choices=("c10d", "etcd"), default="c10d")
    p.add_argument("--endpoint", required=True, help="HOST:PORT of the TCPStore (c10d) or etcd server")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--rounds", type=int, choices=(1, 2), default=1,
                   help="2: after every agent of this process joined, print ROUND1, wait for GO on stdin "
                        "and have every agent join again (a restart); report that second round")
    a = p.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL)
    if os.environ.get("RDZV_SCALE_LOG"):  # debugging aid: elaunch's DEBUG lines of this process, timestamped
        import logging

        logging.basicConfig(filename=os.path.join(os.environ["RDZV_SCALE_LOG"], f"worker-{os.getpid()}.log"),
                            level=logging.DEBUG, format="%(created).3f %(threadName)s %(name)s %(message)s")
    make = _make_etcd_handlers if a.backend == "etcd" else _make_handlers
    handlers = make(a.impl, a.endpoint, a.n, a.count, a.run_id, a.timeout)
    if a.impl == "elaunch":
        # as the elaunch command's agent does once its handler exists; torchrun's does not
        from elaunch.agent.heap import freeze_startup_heap

        freeze_startup_heap()
    if COLLECTOR_OFF:
        gc.disable()
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    if not line or line[0] != "GO":
        os._exit(3)
    results: list[dict[str, Any]] = [{} for _ in handlers]
    first_done = threading.Event()  # every agent joined the first round, or one failed
    first_round = threading.Barrier(len(handlers), action=first_done.set) if a.rounds == 2 else None
    again = threading.Event()  # GO for the second round

    def join(i: int, handler: Any, counter: Any) -> None:
        base = 0
        try:
            handler.next_rendezvous()
            if first_round is not None:
                first_round.wait(a.timeout)
                again.wait()
                base = counter.ops  # the restart round's ops only
                handler.next_rendezvous()
            results[i] = {"t": time.time(), "ops": counter.ops - base, "err": None}
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
            if first_round is not None and not again.is_set():
                first_round.abort()  # the others stop waiting for us
                first_done.set()
            results[i] = {"t": time.time(), "ops": counter.ops - base, "err": f"{type(exc).__name__}: {exc}"[:300]}

    threads = [threading.Thread(target=join, args=(i, h, s), daemon=True) for i, (h, s) in enumerate(handlers)]
    for t in threads:
        t.start()
    if first_round is not None:
        first_done.wait()
        print("ROUND1 " + ("failed" if first_round.broken else "ok"), flush=True)
        sys.stdin.readline()
        again.set()
    deadline = time.monotonic() + a.timeout + 5  # from the (last) go
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for r in results:
        if not r:
            r.update({"t": None, "ops": None, "err": "timeout"})
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip shutdown: closing 100s of handlers would only add noise


def one_round(impl: str, n: int, timeout: float, backend: str = "c10d", endpoint: str | None = None,
              restart: bool = False) -> dict[str, Any]:
    """Run one round of ``n`` agents of ``impl``.

    Args:
        backend: ``c10d`` (a TCPStore is hosted here for the round) or ``etcd``
            (the agents use the etcd server at ``endpoint``, ``HOST:PORT``).
        restart: time a restart instead: once all ``n`` agents completed a first
            round, all call ``next_rendezvous()`` again (leave it, join the next);
            seconds run from that second "go" and ops count the second call only.

    Returns:
        ``{"seconds": float | None, "ops": [per-agent ops], "error": str | None}``;
        seconds is None when the round did not complete within ``timeout`` seconds.
        A completed round adds ``"finish"``: each agent's seconds from go to its
        return, sorted (``seconds`` is the last).
    """
    server = None
    if backend == "c10d":
        import datetime

        from torch.distributed import TCPStore

        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout + 30), use_libuv=True)
        endpoint = f"127.0.0.1:{server.port}"
    assert endpoint, "an etcd round needs the server's endpoint"
    nproc = _procs_for(n)
    counts = [n // nproc + (1 if i < n % nproc else 0) for i in range(nproc)]
    run_id = f"bench-scale-{backend}-{impl}-{n}-{os.getpid()}-{time.time_ns()}"
    procs: list[subprocess.Popen] = []
    # a bound on the whole round, so a stuck worker process cannot hang the benchmark
    watchdog = threading.Timer(timeout + 180, lambda: [p.kill() for p in list(procs)])
    watchdog.daemon = True
    watchdog.start()
    try:
        for c in counts:
            cmd = [sys.executable, "-m", "benchmarks.rdzv_scale", "worker", "--impl", impl, "--backend", backend,
                   "--endpoint", endpoint, "--n", str(n), "--count", str(c), "--run-id", run_id,
                   "--timeout", str(timeout), "--rounds", "2" if restart else "1"]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True, env=launcher_env(), cwd=str(REPO)))
        for p in procs:
            if p.stdout.readline().strip() != "READY":  # blocks until the handlers exist
                return {"seconds": None, "ops": [], "error": "a worker process failed to build its handlers"}
        go = time.time()
        log_line(f"rdzv_scale: {backend} {impl} N={n}: {nproc} processes ready, go")
        for p in procs:
            p.stdin.write(f"GO {go}\n")
            p.stdin.flush()
        if restart:
            firsts = [p.stdout.readline().split() for p in procs]  # ROUND1 ok|failed, once all agents joined
            go = time.time()
            log_line(f"rdzv_scale: {backend} {impl} N={n}: first round done, every agent joins again")
            for p in procs:
                p.stdin.write("GO\n")
                p.stdin.flush()
            if any(f != ["ROUND1", "ok"] for f in firsts):
                lines = [p.stdout.readline() for p in procs]
                errs = {a["err"] for line in lines if line.strip() for a in json.loads(line) if a["err"]}
                # the first failure breaks the barrier the others wait at: name that one
                why = sorted(e for e in errs if not e.startswith("BrokenBarrierError")) or sorted(errs)
                return {"seconds": None, "ops": [], "error": f"the first round did not complete in {timeout:g} s"
                        + (f" ({why[0].splitlines()[0][:120]})" if why else "")}
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
    finish = sorted(a["t"] - go for a in agents)
    return {"seconds": finish[-1], "ops": [a["ops"] for a in agents], "error": None, "finish": finish}


def _measure(rec: Recorder, sizes: tuple[int, ...], timeout: float, prefix: str, what: str,
             round_fn: Callable[[str, int], dict[str, Any]],
             targets: Callable[[int], tuple[dict | None, dict | None]] = lambda n: (None, None)) -> None:
    """Record ``{prefix}seconds_{n}``, ``{prefix}ops_{n}``, ``{prefix}ops_max_{n}`` per N and launcher.

    ``round_fn(impl, n)`` runs one round (:func:`one_round`); once a launcher misses
    ``timeout`` s (or needed more than a third of it), its larger N are skipped.
    ``what`` goes into the labels; ``targets(n)`` gives the (seconds, ops) targets.
    """
    import statistics

    given_up: dict[str, str] = {}
    for n in sorted(sizes):
        target_s, target_ops = targets(n)
        rec.metric(f"{prefix}seconds_{n}", f"rendezvous scale ({what}): {n} agents, one round", "s", target_s)
        rec.metric(f"{prefix}ops_{n}", f"rendezvous scale ({what}): {OPS_NAME[prefix]} per agent, N={n} (median)",
                   "ops", target_ops)
        rec.metric(f"{prefix}ops_max_{n}", f"rendezvous scale ({what}): {OPS_NAME[prefix]} per agent, N={n} (max)", "ops")
        for impl in LAUNCHERS:
            if impl in given_up:
                for k in ("seconds", "ops", "ops_max"):
                    rec.add(f"{prefix}{k}_{n}", impl, None, given_up[impl])
                continue
            log_line(f"rdzv_scale: {what}: {impl} N={n}")
            r = round_fn(impl, n)
            if r["error"]:
                log_line(f"rdzv_scale: {what}: {impl} N={n}: {r['error']}")
                given_up[impl] = f"skipped (N={n} did not complete)"
            elif r["seconds"] > timeout / 3:  # rounds grow at least linearly with N
                given_up[impl] = f"skipped (N={n} already took {r['seconds']:.0f} s)"
            ops = r["ops"]
            rec.add(f"{prefix}seconds_{n}", impl, r["seconds"], r["error"])
            rec.add(f"{prefix}ops_{n}", impl, statistics.median(ops) if ops and not r["error"] else None, r["error"])
            rec.add(f"{prefix}ops_max_{n}", impl, max(ops) if ops and not r["error"] else None, r["error"])


#: What an "op" is, per metric prefix (see the module docstring).
OPS_NAME = {"": "store ops", "restart_": "store ops", "etcd_": "etcd requests"}


def bench_rdzv_scale(sizes: tuple[int, ...], timeout: float) -> Recorder:
    """N agents, one c10d round, per N and launcher; once a launcher misses ``timeout`` s, larger N are skipped."""
    rec = Recorder("rdzv_scale")
    smallest, largest = min(sizes), max(sizes)

    def targets(n: int) -> tuple[dict | None, dict | None]:
        target_s = _seconds_target(n, 5.0)
        target_ops = ({"kind": "flat", "value": 1.5, "base": f"rdzv_scale.ops_{smallest}",
                       "text": f"independent of N (<= 1.5x N={smallest})"} if n == largest and n != smallest else None)
        return target_s, target_ops

    def restart_targets(n: int) -> tuple[dict | None, dict | None]:
        ops = {"kind": "abs_le", "value": 12, "text": "<= 12"} if n == 1024 else None
        return _seconds_target(n, 5.0), ops

    _measure(rec, sizes, timeout, "", "c10d", lambda impl, n: one_round(impl, n, timeout), targets)
    _measure(rec, sizes, timeout, "restart_", "c10d, restart",
             lambda impl, n: one_round(impl, n, timeout, restart=True), restart_targets)
    return rec


def _seconds_target(n: int, seconds: float) -> dict | None:
    """The target of the 1024-agent round (issue 10: c10d rounds <= 5 s, etcd-v3 <= 10 s)."""
    return {"kind": "abs_le", "value": seconds, "text": f"<= {seconds:g} s"} if n == 1024 else None


def etcd_note() -> str | None:
    """Return why the etcd variant cannot run here (a note for the report), or None when it can."""
    return missing_for_etcd((ETCD_BACKENDS["elaunch"],))


def etcd_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The N of the etcd variant: the c10d ``sizes`` up to :data:`ETCD_MAX_N`."""
    return tuple(n for n in sizes if n <= ETCD_MAX_N)


def bench_rdzv_scale_etcd(rec: Recorder, sizes: tuple[int, ...], timeout: float) -> list[str]:
    """Add the etcd variant's metrics (``etcd_*``) to ``rec``; returns notes for the report.

    Every round gets an etcd server of its own (:func:`one_etcd_round`), as every
    c10d round gets a TCPStore of its own. When the etcd variant cannot run
    (:func:`etcd_note`), or no size is left after the cap, nothing is measured and
    the notes say why.
    """
    if note := etcd_note():
        return [note]
    run = etcd_sizes(sizes)
    notes = []
    if dropped := [n for n in sizes if n not in run]:
        notes.append(f"etcd: N={','.join(map(str, sorted(dropped)))} not run (the etcd variant stops at "
                     f"N={ETCD_MAX_N})")
    if not run:
        return notes
    what = f"etcd: elaunch {ETCD_BACKENDS['elaunch']} vs torchrun {ETCD_BACKENDS['torchrun']}"
    _measure(rec, run, timeout, "etcd_", what, lambda impl, n: one_etcd_round(impl, n, timeout),
             lambda n: (_seconds_target(n, 10.0), None))
    return notes


def one_etcd_round(impl: str, n: int, timeout: float) -> dict[str, Any]:
    """:func:`one_round` of ``impl`` on etcd, against a fresh etcd server started for it and stopped after.

    A server shared by the rounds carried one round's traffic into the next: an
    elaunch round of 1,024 agents took 7.2-8.2 s on an etcd that had first served
    the 8-, 64- and 256-agent rounds of both launchers, against 4.2-6.5 s on a fresh
    one (3 interleaved pairs, 2026-11-27), mostly after torchrun's 256-agent round,
    which runs its 30 s without completing.

    Returns:
        As :func:`one_round`; ``error`` names a server that did not start.
    """
    server = EtcdServer(etcd_binary() or "etcd")
    try:
        server.start()
    except RuntimeError as exc:
        log_line(f"rdzv_scale: {exc}")
        return {"seconds": None, "ops": [], "error": f"the etcd server did not start: {exc}"}
    try:
        log_line(f"rdzv_scale: etcd {server.binary} serves {server.endpoint}")
        return one_round(impl, n, timeout, backend="etcd", endpoint=server.endpoint)
    finally:
        server.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m benchmarks.rdzv_scale worker ... (started by benchmarks.run)")
