"""The goodput benchmark's test cluster: 3 namespace hosts, one agent each, what their workers did.

A :class:`Cluster` starts one launcher agent (elaunch or torchrun, the same flags) per
host of a :class:`tests.multinode.netns.Network`, runs ``benchmarks/workers/goodput_worker.py``
(examples/ddp_digits.py with a step counter), and reads back:

* the workers' step counters (:class:`Worker`: host, rank, world size, pid, start time,
  steps started; the file outlives the process);
* the agents' output with the time each line was first seen (:meth:`Cluster.poll`);
* the shared memory a host's processes hold (``/dev/shm`` paths in their maps and
  descriptors), so a killed node's memory can be dropped as a dead machine's would be.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.common import REPO, launcher_cmd, launcher_env

WORKER = str(REPO / "benchmarks" / "workers" / "goodput_worker.py")
STORE_PORT = 29400
#: Rendezvous settings both launchers get (seconds): a round closes 2 s after its minimum,
#: a node that misses 3 keep-alives (1 s apart) is lost; store reads wait 20 s.
RDZV_CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=20"
#: elaunch only: a node whose workers caused 2 failures in a row sits out for 600 s by default;
#: here the faults are injected at random, not a bad node's, so no node is excluded.
ELAUNCH_CONF = "exclude_after=0"
#: Modules elaunch's warm spares import in advance (what the example imports that costs).
WARM_MODULES = "torch,torch._dynamo,numpy,sklearn.datasets,sklearn.model_selection,sklearn.preprocessing"


@dataclass(frozen=True)
class Worker:
    """One worker process, as its step-counter file tells.

    Attributes:
        host: the host index (1-based); rank, world: RANK and WORLD_SIZE; pid: its pid;
        start: when it started counting (time.time(), s); first: when it started its first
        step (0.0: not yet); count: steps started so far.
    """

    host: int
    rank: int
    world: int
    pid: int
    start: float
    first: float
    count: int

    @property
    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def read_workers(directory: Path) -> list[Worker]:
    """Every worker that ever ran (``w-h<H>-r<R>-n<W>-p<PID>`` files), oldest first."""
    out = []
    for path in directory.glob("w-*"):
        try:
            _, h, r, n, p = path.name.split("-")
            start, first, count = path.read_text().split()
        except (OSError, ValueError):
            continue  # being created
        out.append(Worker(int(h[1:]), int(r[1:]), int(n[1:]), int(p[1:]), float(start), float(first), int(count)))
    return sorted(out, key=lambda w: w.start)


def shm_paths(pids) -> set[str]:
    """Top-level ``/dev/shm`` entries named ``elaunch-*`` that processes ``pids`` map or hold open."""
    found = set()
    for pid in pids:
        names = []
        try:
            names += [line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                      if len(line.split(None, 5)) == 6]
            names += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            pass
        for name in names:
            if name.startswith("/dev/shm/elaunch-"):
                found.add("/dev/shm/" + name[len("/dev/shm/"):].split("/")[0])
    return found


class Agent:
    """One launcher agent in a host; stdout and stderr go to one log file."""

    def __init__(self, host, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.host = host
        self.log = log
        self.killed = False
        self.exited: float | None = None  # time.monotonic() when first seen exited
        self.started = time.time()
        with open(log, "ab") as f:
            self.proc = host.popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env, cwd=str(REPO))


class Cluster:
    """Agents on namespace hosts running the example; see the module docstring.

    Args:
        netns: the tests.multinode.netns module; net: its Network (hosts are added here).
        launcher: ``elaunch`` or ``torchrun``. nnodes: ``--nnodes`` (``2:3`` or ``3``).
        run_id: ``--rdzv-id`` (also names elaunch's node directories).
        workdir: logs, step counters, checkpoint and final-params files go here.
        example_args: the example's arguments. warm: elaunch's ``--warm-start`` (elaunch only).
    """

    def __init__(self, netns, net, launcher: str, nnodes: str, run_id: str, workdir: Path,
                 example_args: list[str], warm: bool) -> None:
        self.netns, self.net, self.launcher, self.nnodes = netns, net, launcher, nnodes
        self.run_id, self.workdir, self.example_args, self.warm = run_id, workdir, example_args, warm
        self.counters = workdir / "counters"
        self.counters.mkdir(parents=True, exist_ok=True)
        self.agents: list[Agent] = []
        self.lines: list[tuple[float, int, str]] = []  # (time seen, host, line)
        self._offsets: dict[Path, int] = {}
        self.shm_seen: set[str] = set()
        self.shm_dropped: set[str] = set()
        self.store_host = None
        self.t_start = time.time()  # set when the run starts (time.time(), s)
        self.t_mono = time.monotonic()  # the same moment on the monotonic clock
        self.deadline = float("inf")  # time.monotonic() by which the run must end

    def start_agent(self, host=None):
        """Start an agent in ``host`` (None: a host added now); the first host holds the c10d store."""
        host = self.net.add_host() if host is None else host
        if self.store_host is None:
            self.store_host = host
        conf = f"is_host={int(host is self.store_host)},{RDZV_CONF}"
        if self.launcher == "elaunch":
            conf += f",{ELAUNCH_CONF}"
        args = [f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.store_host.addr}:{STORE_PORT}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf={conf}",
                f"--local-addr={host.addr}", "--max-restarts=100", f"--log-dir={self.workdir / 'logs'}"]
        if self.launcher == "elaunch" and self.warm:
            args += ["--warm-start", f"--warm-start-modules={WARM_MODULES}"]
        argv = launcher_cmd(self.launcher, *args, WORKER, str(self.counters), *self.example_args)
        env = {**launcher_env(), "GLOO_SOCKET_IFNAME": host.ifname, "GOODPUT_HOST": str(host.index),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.agents.append(Agent(host, argv, self.workdir / f"agent-h{host.index}.log", env))
        return host

    def live_agents(self) -> list[Agent]:
        return [a for a in self.agents if not a.killed and a.proc.poll() is None]

    def poll(self) -> None:
        """Read the agents' new output lines (stamped with the time seen) and the shared memory in use."""
        now = time.time()
        for a in self.agents:
            if a.exited is None and not a.killed and a.proc.poll() is not None:
                a.exited = time.monotonic()
            try:
                with open(a.log, "rb") as f:
                    f.seek(self._offsets.get(a.log, 0))
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[a.log] = self._offsets.get(a.log, 0) + len(complete)
            self.lines += [(now, a.host.index, line) for line in complete.decode(errors="replace").splitlines()]

    def note_shm(self) -> None:
        """Remember the ``/dev/shm/elaunch-*`` entries the hosts' processes use now (checked at the end)."""
        for a in self.live_agents():
            self.shm_seen |= shm_paths(a.host.pids())

    def workers(self) -> list[Worker]:
        return read_workers(self.counters)

    def live_worker(self, host_index: int) -> Worker | None:
        """The newest live worker on host ``host_index`` that has started a step, or None."""
        ws = [w for w in self.workers() if w.host == host_index and w.count >= 1 and w.alive]
        return ws[-1] if ws else None

    def training(self) -> bool:
        """True when the newest rank 0 lives and has started a step (the group trains)."""
        zeros = [w for w in self.workers() if w.rank == 0]
        return bool(zeros) and zeros[-1].alive and zeros[-1].count >= 1

    def kill_worker(self, worker: Worker) -> None:
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def held_shm(self, agent: Agent) -> set[str]:
        """The ``/dev/shm`` entries the processes of ``agent``'s host hold now (read before :meth:`kill_node`)."""
        return shm_paths(agent.host.pids())

    def kill_node(self, agent: Agent) -> list:
        """SIGKILL every process of ``agent``'s host; return them, to wait for with :meth:`drop_shm`.

        Their exit runs at nice 19: a dead machine's memory is freed by no one's CPU, but here the kernel frees
        theirs (gigabytes) on the CPUs the other hosts and the fresh one share."""
        agent.killed = True
        return self.netns.sigkill_namespace_processes(agent.host.ns, nice=19)

    def drop_shm(self, held: set[str], killed: list = ()) -> set[str]:
        """Wait for the ``killed`` processes (:meth:`kill_node`) to go, then remove ``held`` (:meth:`held_shm` of that
        host: a dead machine's memory is gone with it); return it."""
        psutil.wait_procs(list(killed), timeout=10)
        for path in held:
            shutil.rmtree(path, ignore_errors=True)
        self.shm_dropped |= held
        return held

    def node_dir(self, agent: Agent) -> Path:
        """elaunch's node directory of ``agent`` (``/dev/shm/elaunch-<run id>-<agent pid>``)."""
        return Path(f"/dev/shm/elaunch-{self.run_id}-{agent.proc.pid}")

    def stop(self, grace: float = 10.0) -> None:
        """Kill every agent, give what they leave ``grace`` seconds to go (elaunch's reaper cleans
        up after a ``kill -9`` of its agent), then kill every process left in the hosts."""
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.kill()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(h.pids() for h in self.net.hosts):
            time.sleep(0.2)
        for h in self.net.hosts:
            self.netns.kill_namespace_processes(h.ns)
        for a in self.agents:
            try:
                a.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - reported by the leftover check
                pass

    def leftovers(self) -> list[str]:
        """What the run left behind: processes in the hosts, ``/dev/shm`` entries of this run."""
        left = [f"pid {p} in {h.ns}" for h in self.net.hosts for p in h.pids()]
        mine = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"elaunch-{self.run_id}-")]
        left += sorted(set(mine) | {p for p in self.shm_seen if os.path.exists(p)})
        return left
