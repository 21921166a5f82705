"""Node loss after a cut link: two test hosts (network namespaces), one host's link goes down.

Unlike ``scale_down`` (a ``kill -9``, whose closed sockets make the survivor's
collective fail at once), a cut link closes nothing: the survivor's all-reduce
blocks, and only the rendezvous' heartbeats can tell that the other host is gone.
Both launchers run the stamp worker's loop (gloo all-reduce every 0.1 s) with the
same flags and their default rendezvous settings (only ``is_host`` is given: inside
a namespace torchrun cannot tell from the machine's hostname that it holds the store); measured from ``ip link set
eth0 down`` on the host that does not hold the c10d store to the survivor's worker
of the world of 1 started (running) and past its barrier (ready). torchrun never
re-forms (its agent only watches for waiting nodes, and gloo's timeout is 30
minutes): each repeat is bounded by ``cfg.scale_timeout`` and recorded as "never".

Needs root and ``ip`` (the hosts are built by ``tests/multinode/netns.py``); without
them the scenario is skipped with a note.
"""

from __future__ import annotations

import time

from benchmarks.common import Recorder, launcher_cmd, launcher_env, stamps, wait_until
from benchmarks.scenarios import STAMP, BenchConfig, Never, _drive

#: The c10d store's port on the first host (each repeat has a network of its own).
STORE_PORT = 29400


def _netns():
    """The namespace-host module, or None with the reason it cannot run here."""
    from tests.multinode import netns  # the test hosts: the same code the multi-node tests use

    return netns, netns.unavailable_reason()


def bench_link_cut(cfg: BenchConfig) -> tuple[list[Recorder], list[str]]:
    """Two hosts run a world of 2 (c10d, ``--nnodes=1:2``); the second host's link is cut.

    Returns:
        The recorder (empty list when the hosts cannot be built) and notes for the report.
    """
    netns, reason = _netns()
    if reason:
        return [], [f"node loss after a link cut: skipped ({reason})"]
    netns.cleanup_stale()
    bound = cfg.scale_timeout
    rec = Recorder("link_cut")
    rec.metric("running", "node loss after a link cut (2 hosts, c10d): link down -> world of 1 running", "s",
               {"kind": "abs_le", "value": 5.0, "text": "<= 5 s"})
    rec.metric("ready", "node loss after a link cut (2 hosts, c10d): link down -> world of 1 ready", "s")

    def once(which, log, out):
        with netns.Network("-bl") as net:
            h1, h2 = net.add_host(), net.add_host()
            procs = []
            for h in (h1, h2):
                args = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint={h1.addr}:{STORE_PORT}", f"--rdzv-id=bench-cut-{out.name}",
                        f"--local-addr={h.addr}", f"--rdzv-conf=is_host={int(h is h1)}", "--max-restarts=3", STAMP, str(out), "loop", "600"]
                env = {**launcher_env(), "GLOO_SOCKET_IFNAME": h.ifname}
                with open(log, "ab") as f:
                    procs.append(h.popen(launcher_cmd(which, *args), stdout=f, stderr=f, env=env))
            try:
                wait_until(lambda: len(stamps(out, "ready", world=2)) >= 2, 120, "world of 2 ready", tuple(procs))
                t_cut = time.time()
                h2.link_down()
                try:
                    running = wait_until(lambda: stamps(out, "start", world=1, after=t_cut), bound,
                                         "world of 1 running", (procs[0],))
                except Exception as exc:
                    if "did not complete" in str(exc):
                        raise Never(f"never (> {bound:g} s): the survivor's world of 2 still runs") from None
                    raise
                left = max(0.0, t_cut + bound - time.time())
                ready = wait_until(lambda: stamps(out, "ready", world=1, after=t_cut), left, "world of 1 ready",
                                   (procs[0],))
            finally:
                for p in procs:
                    p.kill()
                for h in net.hosts:
                    netns.kill_namespace_processes(h.ns)
                for p in procs:
                    p.wait(timeout=10)
        return {"running": min(running) - t_cut, "ready": min(ready) - t_cut}

    return [_drive(cfg, rec, "link_cut", once)], []
