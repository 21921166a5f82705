"""The node check's child (``--node-check``): ``python _node_check_child.py FD``.

Started by the agent (``agent/node_check.py``) as it joins a round, one per node: it
imports torch (about 2 s, more on a loaded machine) while the rendezvous runs, then
waits for the round's facts, one JSON message on FD: ``round``, ``rank`` and ``world_size`` (the
group's), ``store`` (``[host, port]`` of the round's workers' store), ``host_store``
(this child hosts that store for the check: backends whose workers' rank 0 hosts it,
etcd), ``addr`` (this node's address, for the all-reduce's sockets), ``device``
(``"auto"``: nccl on the node's first GPU when torch sees one, else gloo; ``"cpu"``: gloo),
``budget`` (seconds the check may take once every node's child is there), ``ready_wait``
(seconds to wait for the others' children, which may still import torch: the agent's
``IMPORT_GRACE``).

Then (the agent imports no torch):

1. waits for every node's child at a barrier in the store, up to ``ready_wait`` seconds
   (so the slow start of one interpreter is not taken for a slow link);
2. times the compute probe: :data:`PROBE_MATMULS` matmuls in a row of :data:`PROBE_N` x
   :data:`PROBE_N` float32 matrices (one stretch, so a CPU quota shows);
3. pairing round 1 (``features.node_check.first_pairs``): one all-reduce group of two
   (``ProcessGroupGloo``/``ProcessGroupNCCL`` on a ``PrefixStore`` of the store) per
   pair, a first all-reduce of :data:`BUFFER_BYTES` to connect, then timed ones (the
   median of up to :data:`TIMED_OPS`, fewer once :data:`TIMED_SECONDS` are spent);
   node 0 runs its pairs one after the other, in the order of the list on every node;
4. publishes its round-1 times in the store; node 0 computes round 2's pairs
   (``features.node_check.second_pairs``; a node without times counts as failed) and
   publishes them; the others wait for that list;
5. pairing round 2 as round 1.

It sends one JSON document on FD and exits 0: ``{"compute": seconds, "pairs":
[[pairing round, a, b, seconds or null], ...], "error": null or text, "waited":
seconds at the first barrier, "seconds": the check's own seconds after it}``. A failed all-reduce (its partner gone, a timeout of
:data:`OP_TIMEOUT`) is a null time, not an error: the verdict tells which end was
at fault. An error is what stopped this node's check itself.
"""

from __future__ import annotations

import datetime
import json
import socket
import statistics
import sys
import time

#: The compute probe: PROBE_MATMULS products of N x N float32 matrices in a row, N by device, after PROBE_WARMUP
#: untimed ones (one CPU thread: about 0.13 s on one core of 2024; a GPU's is about as long). Timed as one
#: stretch longer than a CFS period (100 ms), so a CPU quota shows: the fastest of short runs hid a 25 % cap.
PROBE_N, PROBE_MATMULS, PROBE_WARMUP = {"cpu": 256, "cuda": 2048}, 320, 16
#: Bytes each all-reduce sums (float32), by device. gloo: 2 MiB, about 0.35 s each way at 50 Mbit/s, a few
#: milliseconds on a healthy link (a link must fall below about 1 Gbit/s to cost the verdict's 20 ms noise floor).
#: NCCL: 256 MiB, about 10 ms at 400 Gbit/s, so a GPU node's link at a quarter of its rate costs tens of ms.
BUFFER_BYTES = {"cpu": 2 << 20, "cuda": 256 << 20}
#: Timed all-reduces per pair at most, and the seconds after which no more are started (at least one is).
TIMED_OPS, TIMED_SECONDS = 3, 1.0
#: Seconds one all-reduce (and forming its group of two) may take before the pair counts as failed.
OP_TIMEOUT = 5.0


def _deadline_left(deadline: float, floor: float = 0.1) -> float:
    return max(floor, deadline - time.monotonic())


def _probe(torch, device: str) -> float:
    """Seconds of PROBE_MATMULS matmuls in a row (after PROBE_WARMUP untimed ones)."""
    n = PROBE_N[device]
    a = torch.rand(n, n, device=device)
    b = torch.rand(n, n, device=device)

    def run(count: int):
        nonlocal a
        for _ in range(count):
            a = torch.mm(a, b).clamp_(-1, 1)
        if device != "cpu":
            torch.cuda.synchronize()

    run(PROBE_WARMUP)
    t = time.perf_counter()
    run(PROBE_MATMULS)
    return time.perf_counter() - t


class _Pairs:
    """Runs one node's all-reduces with its partners over ``store``."""

    def __init__(self, torch, dist, store, rank: int, addr: str, device: str) -> None:
        self.torch, self.dist, self.store, self.rank, self.device = torch, dist, store, rank, device
        self._addr = addr
        self.buf = torch.ones(BUFFER_BYTES[device] // 4, device=device)

    def _group(self, prefix: str, me: int):
        dist = self.dist
        store = dist.PrefixStore(prefix, self.store)
        timeout = datetime.timedelta(seconds=OP_TIMEOUT)
        if self.device == "cpu":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._addr)]
            return dist.ProcessGroupGloo(store, me, 2, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, me, 2, opts)

    def _op(self, group) -> float:
        t = time.perf_counter()
        group.allreduce([self.buf]).wait()
        if self.device != "cpu":
            self.torch.cuda.synchronize()
        return time.perf_counter() - t

    def time_pair(self, pairing: int, a: int, b: int) -> float | None:
        """Seconds of one all-reduce with the partner (the median of the timed ones), None when it failed."""
        try:
            group = self._group(f"pair/{pairing}/{a}-{b}", 0 if self.rank == a else 1)
            self._op(group)  # connects
            times: list[float] = []
            spent = 0.0
            while len(times) < TIMED_OPS and (not times or spent < TIMED_SECONDS):
                times.append(self._op(group))
                spent += times[-1]
            return statistics.median(times)
        except Exception:  # noqa: BLE001 - the partner's end, a timeout: the verdict weighs it
            return None

    def run(self, pairing: int, pairs: list[tuple[int, int]]) -> dict[tuple[int, int], float | None]:
        return {(a, b): self.time_pair(pairing, a, b) for a, b in pairs if self.rank in (a, b)}


def _barrier(store, key: str, n: int, deadline: float) -> bool:
    """Count in at ``key`` and wait until ``n`` did, or ``deadline``; True when all came."""
    count = store.add(key, 1)
    while count < n and time.monotonic() < deadline:
        time.sleep(0.01)
        count = store.add(key, 0)
    return count >= n


def _second_round(store, rank: int, n: int, mine: dict, deadline: float) -> list[tuple[int, int]]:
    """Publish this node's round-1 times; node 0 plans round 2 from everyone's, the others wait for its plan."""
    from elaunch.features.node_check import first_pairs, second_pairs

    store.set(f"r1/{rank}", json.dumps([[a, b, t] for (a, b), t in mine.items()]))
    if rank == 0:
        times: dict[tuple[int, int], float | None] = {}
        wanted = {g for p in first_pairs(n) for g in p}
        seen: set[int] = set()
        while wanted - seen and time.monotonic() < deadline:
            for g in sorted(wanted - seen):
                if store.check([f"r1/{g}"]):
                    seen.add(g)
                    for a, b, t in json.loads(store.get(f"r1/{g}")):
                        old = times.get((a, b), 0.0)
                        times[(a, b)] = None if t is None or old is None else max(old, t)
            if wanted - seen:
                time.sleep(0.01)
        plan = second_pairs(n, times)
        store.set("plan2", json.dumps(plan))
        return plan
    store.set_timeout(datetime.timedelta(seconds=_deadline_left(deadline)))
    try:
        return [tuple(p) for p in json.loads(store.get("plan2"))]
    except Exception:  # noqa: BLE001 - node 0's check is gone: no round 2 here
        return []


def check(torch, dist, args: dict) -> dict:
    """Run the check as the module docstring says; return the document to send."""
    from elaunch.features.node_check import first_pairs

    started = time.monotonic()
    budget, ready_wait = float(args["budget"]), float(args.get("ready_wait", 30.0))
    torch.set_num_threads(1)
    rank, n = int(args["rank"]), int(args["world_size"])
    device = "cuda" if args.get("device", "auto") == "auto" and torch.cuda.is_available() else "cpu"
    host, port = args["store"]
    timeout = datetime.timedelta(seconds=ready_wait + budget)
    base = dist.TCPStore(host, int(port), is_master=bool(args.get("host_store")), timeout=timeout,
                         wait_for_workers=False, multi_tenant=True)
    store = dist.PrefixStore(f"elaunch/node_check/{args['round']}", base)
    # the others' children may still import torch: wait for them as long as their agents would
    _barrier(store, "ready", n, started + ready_wait)
    checked = time.monotonic()
    deadline = checked + budget
    doc: dict = {"compute": _probe(torch, device), "pairs": [], "error": None, "waited": checked - started}
    pairs = _Pairs(torch, dist, store, rank, args["addr"], device)
    r1 = pairs.run(1, first_pairs(n))
    doc["pairs"] += [[1, a, b, t] for (a, b), t in r1.items()]
    r2 = pairs.run(2, _second_round(store, rank, n, r1, deadline))
    doc["pairs"] += [[2, a, b, t] for (a, b), t in r2.items()]
    _barrier(store, "done", n, deadline)  # node 0 may host the store: leave together
    doc["seconds"] = time.monotonic() - checked
    return doc


def main(fd: int) -> int:
    """Import torch, wait for the round's facts on ``fd``, check, send the document; 0 also on end of file."""
    chan = socket.socket(fileno=fd)
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - reported once the round's facts come
        torch = dist = exc
    raw = chan.recv(1 << 16)
    if not raw:
        return 0  # the agent is gone or needs no check this time
    try:
        if isinstance(torch, Exception):
            raise torch
        doc = check(torch, dist, json.loads(raw))
    except Exception as exc:  # noqa: BLE001 - reported to the agent, which names this node failed
        doc = {"compute": None, "pairs": [], "error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        chan.send(json.dumps(doc).encode())
    except OSError:
        return 1  # the agent gave up on the check
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
