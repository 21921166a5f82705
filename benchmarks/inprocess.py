"""In-process restart (issue 37, "Measure"): ``python -m benchmarks.inprocess [--quick] [--json FILE]``.

**Fault -> training**: the time from a worker's fault until the first training step after it
has completed on every rank of the job, side by side in one run for:

* ``elaunch_inprocess``: elaunch, the worker opts in to in-process restart (``@elaunch.restartable``);
  ``elaunch_inprocess_warm``: the same with ``--warm-start`` (a killed rank's replacement starts
  from a spare interpreter with torch imported);
* ``elaunch_full``: elaunch's full restart, the same script not opted in; ``elaunch_full_warm``:
  the same with ``--warm-start`` (spare interpreters with torch imported);
* ``nvrx``: nvidia-resiliency-ext's ``inprocess.Wrapper`` around the same ``main()``, under its
  own launcher as its docs run in-process restart (``examples/fault_tolerance/
  run_inprocess_injob_example.sh``): one ``ft_launcher`` agent per rank,
  ``--nnodes=2:3 --ft-restart-policy=min-healthy``, NIC monitor off; the Wrapper's defaults
  (1 s intervals, ``last_call_wait`` 1 s); ``nvrx_fast``: every interval and ``last_call_wait``
  0.1 s;
* ``torchrun``: the script not opted in.

**A torch.compile'd model** (``kill_compiled.*``, ``raise_compiled.*``): the same job with the
worker's ``--compile`` (``torch.compile`` of the model DDP wraps, inductor on the CPU, built
again by every call of main()). Next to fault -> training, two rows per way give the first
forward after the fault (where dynamo and inductor compile forward and backward, before any
collective): the slowest of the processes kept, and of the processes started anew. A kept
process keeps dynamo's and inductor's in-memory caches; a new one (a full restart's every
worker, an in-process restart's replacement) compiles again, from inductor's on-disk cache
(``/tmp/torchinductor_<user>``, warm after the job's first compile). After a SIGKILL the
replacement compiles, so the job trains again only when it has; after a raise every process
is kept.

The job: 3 workers on this machine (``--standalone``/one host), ``benchmarks/workers/
inprocess_train.py``: a gloo ``DistributedDataParallel`` model (``--dim``/``--layers``, 4 MiB
of gradients all-reduced a step), ~60 ms a step, ``elaunch.checkpoint.save`` of model and
optimizer after every step and ``ckpt.load(into=...)`` at main()'s start (under elaunch the
agent's memory; under torchrun and ft_launcher the same calls write a directory in
``/dev/shm``). ``init_process_group``'s ``timeout`` is the same for every way of a fault: 10 s in
the raise rows (NVRx's survivors wait for it), 30 s in the kill rows (a restarted group's first
collectives wait for its slowest worker, importing torch cold on 2 loaded cores: at 10 s,
torchrun's first restarted group once failed on a 10 s recv timeout, and the attempts after it
failed within ~2 s each in gloo's connectFullMesh, "Connection refused" to a peer's address).

Faults: ``kill``: the driver SIGKILLs the worker of a rank drawn (seeded) among ranks 1-2
(rank 0 hosts NVRx's store: its loss ends an NVRx job by design), ``Sizes.every`` seconds (5; --quick 2) after
the job trains again; the fault's time is taken just before ``kill``. ``raise``: the driver
names a rank in ``OUT/raise`` and that rank raises RuntimeError after its step; the fault's
time is the rank's own, just before the raise. Each worker journals every step with
``time.time()`` (CLOCK_REALTIME, one clock for every process of the machine); the
recovery is the first step, per rank, of a main() call that began after the fault, and the
row's sample is the slowest rank's. For each fault the row also keeps the world size after
it and the survivors whose processes were kept (``pids_kept``: same pid, new main() call).

An NVRx job takes one SIGKILL (the world shrinks to 2; a second would leave fewer healthy
agents than ``--nnodes``' minimum, and ft_launcher restarts everything): each NVRx kill is
a fresh job. Every other way takes its faults in one job.

A way that cannot run (the feature not in this checkout, NVRx not installed, no recovery
within the bound) is a row "not run: <why>"; the other rows still run.

The end: the driver writes ``OUT/stop``, the workers return from main() at the same step, and
the launchers get 30 s to exit by themselves before the job's processes are killed; each
row says how many of its jobs ended by themselves.

``--device cuda`` (the GPU check, ``scripts/gpu_check_inprocess.sh``): the workers use nccl and the
GPU; they run through ``scripts/gpu_shared.py``, so with fewer GPUs than ranks they share one (a
``NCCL_HOSTID`` a rank). Each
fault's sample then also says how long the new ranks took to their first step, by phase
(``phases_s``). ``--agent-args``: more flags for elaunch's agents (``--inprocess-timeout=8``: what a
survivor that never answers the abort costs).

Prints a markdown table; ``--json FILE`` writes meta, rows and the raw samples.

NVRx: ``pip install nvidia-resiliency-ext==0.4.1`` (the ``nvrx`` extra). It pulls in the
deprecated ``pynvml`` shim, whose import makes every ``import torch`` print a FutureWarning;
``pip uninstall pynvml`` removes it (``nvidia-ml-py``, also pulled in, provides the module).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from benchmarks.common import REPO, DidNotComplete, emit, free_port, kill_tree, launcher_cmd, launcher_env, log_line

WORKER = str(REPO / "benchmarks" / "workers" / "inprocess_train.py")
#: ``--device cuda`` runs the worker through it: ranks may share a GPU (a ``NCCL_HOSTID`` each where there are fewer)
GPU_SHARED = str(REPO / "scripts" / "gpu_shared.py")
TAG_VAR = "ELAUNCH_BENCH_INPROCESS_TAG"  # every process of a job carries it: what is left is found by it
NPROC = 3
#: --hosts 3: the c10d store's port on the first host, and the rendezvous settings of benchmarks/goodput_hosts.py
#: (elaunch and torchrun alike; ft_launcher keeps its defaults, as NVRx's example runs it)
STORE_PORT = 29400
RDZV_CONF = "last_call_timeout=2,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=20"
ELAUNCH_CONF = "exclude_after=0"  # a node whose workers failed twice in a row is not sat out: the faults are ours


@dataclass(frozen=True)
class Way:
    """One way of recovering: a launcher, the worker's mode, and the fault it takes.

    Attributes:
        key: ``<fault>.<name>``; launcher: ``elaunch``, ``torchrun`` or ``ft_launcher``;
        mode: the worker's ``--mode``; fault: ``kill`` or ``raise``; args: the launcher's extra
        flags; nvrx_interval: the Wrapper's intervals (s; None: its defaults); one_fault: a
        fresh job per fault; needs: what must be importable (``elaunch.restartable``, ``nvrx``).
    """

    key: str
    label: str
    launcher: str
    mode: str
    fault: str
    args: tuple[str, ...] = ()
    nvrx_interval: float | None = None
    one_fault: bool = False
    needs: str = ""
    worker_args: tuple[str, ...] = ()


WAYS = (
    Way("kill.elaunch_inprocess", "elaunch, in-process restart (@elaunch.restartable)", "elaunch", "elaunch", "kill",
        needs="restartable"),
    Way("kill.elaunch_inprocess_warm", "elaunch, in-process restart, --warm-start (the replacement from a spare)",
        "elaunch", "elaunch", "kill", ("--warm-start",), needs="restartable"),
    Way("kill.elaunch_full", "elaunch, full restart (today)", "elaunch", "plain", "kill"),
    Way("kill.elaunch_full_warm", "elaunch, full restart, --warm-start", "elaunch", "plain", "kill",
        ("--warm-start",)),
    Way("kill.nvrx", "NVRx inprocess.Wrapper, defaults (ft_launcher min-healthy)", "ft_launcher", "nvrx", "kill",
        one_fault=True, needs="nvrx"),
    Way("kill.nvrx_fast", "NVRx inprocess.Wrapper, 0.1 s intervals (ft_launcher min-healthy)", "ft_launcher",
        "nvrx", "kill", nvrx_interval=0.1, one_fault=True, needs="nvrx"),
    Way("kill.torchrun", "torchrun (full restart)", "torchrun", "plain", "kill"),
    Way("raise.elaunch_inprocess", "elaunch, in-process restart (@elaunch.restartable)", "elaunch", "elaunch",
        "raise", needs="restartable"),
    Way("raise.nvrx", "NVRx inprocess.Wrapper, defaults (ft_launcher min-healthy)", "ft_launcher", "nvrx", "raise",
        needs="nvrx"),
    Way("raise.nvrx_fast", "NVRx inprocess.Wrapper, 0.1 s intervals (ft_launcher min-healthy)", "ft_launcher",
        "nvrx", "raise", nvrx_interval=0.1, needs="nvrx"),
    # torch.compile'd model: what a full restart pays again in compilation, that survivors kept in process do not
    Way("kill_compiled.elaunch_inprocess_warm", "elaunch, in-process restart, --warm-start", "elaunch", "elaunch",
        "kill", ("--warm-start",), needs="restartable", worker_args=("--compile",)),
    Way("kill_compiled.elaunch_full_warm", "elaunch, full restart, --warm-start", "elaunch", "plain", "kill",
        ("--warm-start",), worker_args=("--compile",)),
    Way("kill_compiled.torchrun", "torchrun (full restart)", "torchrun", "plain", "kill", worker_args=("--compile",)),
    Way("raise_compiled.elaunch_inprocess", "elaunch, in-process restart (every process kept)", "elaunch", "elaunch",
        "raise", needs="restartable", worker_args=("--compile",)),
    Way("raise_compiled.elaunch_full", "elaunch, full restart", "elaunch", "plain", "raise",
        worker_args=("--compile",)),
)
#: Each row's ratio is against this row (the same fault; the first part of the key).
VS = {"kill": "kill.torchrun", "raise": "raise.nvrx", "kill_compiled": "kill_compiled.torchrun",
      "raise_compiled": "raise_compiled.elaunch_full"}
TARGET = {"kind": "abs_le", "value": 0.5, "text": "<= 0.5 s, failed rank replaced (world size kept)"}


@dataclass(frozen=True)
class Sizes:
    reps: int  # faults per way
    every: float  # seconds of training between a recovery and the next fault
    dim: int
    layers: int
    step_sleep: float
    pg_timeout: float  # the process groups' gloo timeout (seconds) in the raise rows: NVRx's survivors wait for it
    pg_timeout_kill: float  # the same in the kill rows (it bounds a restarted group's start too: cold under load)
    warmup_steps: int = 5  # steps every rank has done before the first fault


FULL = Sizes(reps=5, every=5.0, dim=512, layers=4, step_sleep=0.03, pg_timeout=10.0, pg_timeout_kill=30.0)
QUICK = Sizes(reps=1, every=2.0, dim=128, layers=2, step_sleep=0.03, pg_timeout=10.0, pg_timeout_kill=30.0,
              warmup_steps=3)


# -- the workers' journal ----------------------------------------------------------------------------------------

class Journal:
    """The records the job's workers appended to ``OUT/journal/<pid>.jsonl``, read incrementally."""

    def __init__(self, out: Path) -> None:
        self.dir = out / "journal"
        self.records: list[dict] = []
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict]:
        for path in sorted(self.dir.glob("*.jsonl")) if self.dir.exists() else ():
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + end
            self.records += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return self.records

    def steps(self) -> list[dict]:
        return [r for r in self.poll() if r["ev"] == "step"]

    def current(self) -> dict[int, dict]:
        """Rank -> the last step record of the newest main() call that stepped (the round that trains now)."""
        steps = self.steps()
        if not steps:
            return {}
        newest = max(r["call"] for r in steps)
        world = next(r["world"] for r in steps if r["call"] == newest)
        # the round of the newest call: every rank's newest call started within the round's own start
        last: dict[int, dict] = {}
        for r in steps:
            if r["world"] == world and (r["rank"] not in last or r["t"] >= last[r["rank"]]["t"]):
                last[r["rank"]] = r
        return last

    def recovered(self, t_fault: float) -> dict[int, dict] | None:
        """Rank -> its first step of a main() call begun after ``t_fault``, once every rank of that round has one."""
        first: dict[int, dict] = {}
        for r in self.steps():
            if r["call"] > t_fault and r["t"] > t_fault and (r["rank"] not in first or r["t"] < first[r["rank"]]["t"]):
                first[r["rank"]] = r
        if not first:
            return None
        world = max(r["world"] for r in first.values())
        ranks = {k: v for k, v in first.items() if v["world"] == world}
        return ranks if set(ranks) == set(range(world)) else None

    def count(self, ev: str, after: float) -> list[dict]:
        return [r for r in self.poll() if r["ev"] == ev and r["t"] > after]


# -- a job --------------------------------------------------------------------------------------------------------

class Job:
    """One launch of the worker under a way's launcher (one process, or one ft_launcher per rank)."""

    def __init__(self, way: Way, sizes: Sizes, work: Path, seed: int, net=None, device: str = "cpu",
                 agent_args: tuple[str, ...] = ()) -> None:
        self.way, self.sizes, self.work, self.net, self.device = way, sizes, work, net, device
        self.agent_args = agent_args if way.launcher == "elaunch" else ()
        self.out = work / "out"
        self.out.mkdir(parents=True)
        self.tag = f"{os.getpid()}-{work.name}-{time.time_ns()}"
        self.shm = Path(f"/dev/shm/elaunch-bench-inprocess-{self.tag}")
        self.procs: list[subprocess.Popen] = []
        self.journal = Journal(self.out)
        self.rng = random.Random(seed)
        self.faulted = False  # a fault was injected (a failure after it is the way's, not the job's start)

    def _env(self) -> dict[str, str]:
        env = {**launcher_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TAG_VAR: self.tag,
               "TORCH_CPP_LOG_LEVEL": "ERROR"}
        if self.way.launcher != "elaunch":  # ckpt.save/load without an agent: the persisted layout, in memory here
            env["ELAUNCH_CHECKPOINT_DIR"] = str(self.shm)
        return env

    @property
    def pg_timeout(self) -> float:
        return self.sizes.pg_timeout if self.way.fault == "raise" else self.sizes.pg_timeout_kill

    def _worker_args(self) -> list[str]:
        s = self.sizes
        args = [*([GPU_SHARED] if self.device == "cuda" else []), WORKER, str(self.out), "--mode", self.way.mode,
                "--pg-timeout", str(self.pg_timeout), "--step-sleep", str(s.step_sleep), "--dim", str(s.dim),
                "--layers", str(s.layers), "--device", self.device]
        if self.way.nvrx_interval is not None:
            args += ["--nvrx-interval", str(self.way.nvrx_interval)]
        return args + list(self.way.worker_args)

    def start(self) -> None:
        if self.net is not None:
            self._start_hosts()
            return
        env = self._env()
        if self.way.launcher == "ft_launcher":
            port = free_port()
            for i in range(NPROC):  # as NVRx's run_inprocess_injob_example.sh: one agent a node, min-healthy
                argv = [str(Path(sys.executable).parent / "ft_launcher"), "--nnodes=2:3", "--nproc-per-node=1",
                        "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                        f"--rdzv-id=ipb{self.tag}", f"--rdzv-conf=is_host={int(i == 0)}",
                        "--ft-restart-policy=min-healthy", "--ft-enable-nic-monitor=False", *self._worker_args()]
                self._popen(argv, env, f"launcher-{i}.log")
            return
        argv = launcher_cmd(self.way.launcher, "--standalone", f"--nproc-per-node={NPROC}", "--max-restarts=100",
                            *self.way.args, *self.agent_args, *(["--log-dir", str(self.work / "logs")]
                                              if self.way.launcher == "elaunch" else []),
                            *self._worker_args())
        self._popen(argv, env, "launcher.log")

    def _start_hosts(self) -> None:
        """One agent on each of NPROC namespace hosts, one worker each; the first host holds the c10d store."""
        hosts = [self.net.add_host() for _ in range(NPROC)]
        endpoint = f"{hosts[0].addr}:{STORE_PORT}"
        for host in hosts:
            env = {**self._env(), "GLOO_SOCKET_IFNAME": host.ifname}
            common = ["--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                      f"--rdzv-id=ipb{self.tag}", f"--local-addr={host.addr}"]
            is_host = f"is_host={int(host is hosts[0])}"
            if self.way.launcher == "ft_launcher":  # as NVRx's example: min-healthy, its rendezvous defaults
                argv = [str(Path(sys.executable).parent / "ft_launcher"), "--nnodes=2:3", "--max-restarts=2",
                        *common, f"--rdzv-conf={is_host}", "--ft-restart-policy=min-healthy",
                        "--ft-enable-nic-monitor=False"]
            else:
                conf = f"{is_host},{RDZV_CONF}" + (f",{ELAUNCH_CONF}" if self.way.launcher == "elaunch" else "")
                argv = launcher_cmd(self.way.launcher, f"--nnodes={NPROC}", "--max-restarts=100", *common,
                                    f"--rdzv-conf={conf}", *self.way.args, *self.agent_args,
                                    *(["--log-dir", str(self.work / f"logs-h{host.index}")]
                                      if self.way.launcher == "elaunch" else []))
            self._popen(argv + self._worker_args(), env, f"launcher-h{host.index}.log", host)

    def _popen(self, argv: list[str], env: dict, log: str, host=None) -> None:
        with open(self.work / log, "ab") as f:
            kw = dict(stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(self.work))
            self.procs.append(host.popen(argv, **kw) if host is not None else subprocess.Popen(argv, **kw))

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.01, any_exit: bool = False):
        """Poll ``predicate()`` until truthy.

        Raises:
            DidNotComplete: ``timeout`` s passed, or every launcher exited (``any_exit``: one did).
        """
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if (any if any_exit else all)(p.poll() is not None for p in self.procs):
                raise DidNotComplete(f"the launcher exited ({[p.returncode for p in self.procs]}) while waiting for "
                                     f"{what}; logs: {self.work}")
            if time.monotonic() > deadline:
                raise DidNotComplete(f"no {what} within {timeout:g} s; logs: {self.work}")
            time.sleep(interval)

    def training(self, steps: int) -> dict[int, dict] | None:
        cur = self.journal.current()
        world = next(iter(cur.values()))["world"] if cur else 0
        if cur and set(cur) == set(range(world)) and all(r["step"] >= steps for r in cur.values()):
            return cur
        return None

    def fault(self) -> dict:
        """Inject the way's fault once the job trains; wait until it trains again; return the sample."""
        s = self.sizes
        self.wait(lambda: self.training(s.warmup_steps), 120, "training before the fault", interval=0.05, any_exit=True)
        pause_end = time.monotonic() + s.every
        self.wait(lambda: time.monotonic() >= pause_end, s.every + 1, "a pause", interval=0.05)
        before = self.journal.current()
        world = len(before)
        rank = self.rng.choice(range(1, world))
        victim = before[rank]["pid"]
        self.faulted = True
        if self.way.fault == "kill":
            t_fault = time.time()
            os.kill(victim, signal.SIGKILL)
        else:
            tmp = self.out / "raise.tmp"
            tmp.write_text(str(rank))
            t_ask = time.time()
            os.rename(tmp, self.out / "raise")
            raised = self.wait(lambda: self.journal.count("raise", t_ask), 30, "the planted raise")
            t_fault = raised[0]["t"]
        bound = 60 + 2 * self.pg_timeout
        after = self.wait(lambda: self.journal.recovered(t_fault), bound, "training after the fault", interval=0.01)
        t_done = max(r["t"] for r in after.values())
        kept = sorted(r for r, rec in before.items()
                      if r != rank or self.way.fault == "raise"
                      if rec["pid"] in {a["pid"] for a in after.values()})
        survivors = [r for r in before if r != rank or self.way.fault == "raise"]
        return {"t_fault": t_fault, "seconds": t_done - t_fault, "rank": rank, "pid": victim,
                "world_before": world, "world_after": len(after), "pids_kept": len(kept), "survivors": len(survivors),
                "per_rank_s": {str(r): round(a["t"] - t_fault, 4) for r, a in sorted(after.items())},
                "resumed_step": {str(r): a["step"] for r, a in sorted(after.items())},
                "first_fwd_s": {str(r): a.get("first_fwd_s") for r, a in sorted(after.items())},
                "phases_s": {str(r): a.get("phases_s") for r, a in sorted(after.items())},
                "kept_ranks": kept,
                "step_before": max(r["step"] for r in before.values())}

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """Ask the workers to stop, wait for the launchers (``timeout`` s), then kill whatever of the job is left.

        Returns:
            The launchers' exit codes; None: still running after ``timeout`` s (then killed).
        """
        (self.out / "stop").touch()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = [p.poll() for p in self.procs]
        self.close()
        return codes

    def close(self) -> None:
        for p in self.procs:
            kill_tree(p.pid)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(TAG_VAR) == self.tag:
                    left.append(proc)
            except psutil.Error:
                pass
        for proc in left:  # a process that left the launchers' trees (a daemon, a reparented monitor)
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        if self.net is not None:
            from tests.multinode import netns

            for host in self.net.hosts:
                netns.kill_namespace_processes(host.ns)
        shutil.rmtree(self.shm, ignore_errors=True)


# -- the ways -----------------------------------------------------------------------------------------------------

def unavailable(way: Way) -> str | None:
    """Why ``way`` cannot run in this checkout, or None."""
    if way.needs == "restartable":
        probe = subprocess.run([sys.executable, "-c", "import elaunch; elaunch.restartable"], cwd=str(REPO),
                               env=launcher_env(), capture_output=True, text=True, timeout=60)
        if probe.returncode:
            return f"elaunch.restartable is not in this checkout ({probe.stderr.strip().splitlines()[-1:]})"
    if way.needs == "nvrx":
        if not (Path(sys.executable).parent / "ft_launcher").exists():
            return "nvidia-resiliency-ext is not installed (pip install nvidia-resiliency-ext==0.4.1)"
    return None


def prefix(hosts: int) -> str:
    """The row keys' prefix: none on one host, ``hosts3.`` on 3 namespace hosts."""
    return "" if hosts == 1 else f"hosts{hosts}."


def run_way(way: Way, sizes: Sizes, root: Path, seed: int, hosts: int = 1, device: str = "cpu",
            agent_args: tuple[str, ...] = ()) -> dict:
    """Measure ``way``: ``sizes.reps`` faults (one job, or one job per fault); return its raw result."""
    key = prefix(hosts) + way.key
    res: dict = {"key": key, "way": way.key, "hosts": hosts, "samples": [], "note": None, "exit_codes": []}
    why = unavailable(way)
    if why:
        res["note"] = f"not run: {why}"
        return res
    jobs = 0
    while len(res["samples"]) < sizes.reps:
        jobs += 1
        if hosts == 1:
            ok = _job(way, sizes, root / key.replace(".", "-") / f"job{jobs}", seed + jobs, None, res, device,
                      agent_args)
        else:
            from tests.multinode import netns

            with netns.Network("-ipb") as net:
                ok = _job(way, sizes, root / key.replace(".", "-") / f"job{jobs}", seed + jobs, net, res, device,
                          agent_args)
        if not ok and not res.get("retry"):
            break
    return res


def _job(way: Way, sizes: Sizes, work: Path, seed: int, net, res: dict, device: str = "cpu",
         agent_args: tuple[str, ...] = ()) -> bool:
    """One job of ``way``: its faults' samples go to ``res``; False when it did not recover (``res['note']``)."""
    job = Job(way, sizes, work, seed, net, device, agent_args)
    try:
        job.start()
        for _ in range(1 if way.one_fault else sizes.reps - len(res["samples"])):
            sample = job.fault()
            res["samples"].append(sample)
            log_line(f"{res['key']}: {sample['seconds']:.3f} s, world {sample['world_before']} -> "
                     f"{sample['world_after']}, kept {sample['pids_kept']} of {sample['survivors']}")
        res["exit_codes"].append(job.stop())
        return True
    except DidNotComplete as exc:
        # a job that never trained (a launcher that could not listen on its port: the port picked was taken
        # meanwhile) gets one more try; a fault it did not recover from is the way's result
        res["retry"] = not job.faulted and not res.get("retried")
        res["retried"] = res.get("retried", False) or res["retry"]
        if not res["retry"]:
            res["note"] = f"not run: {exc}" if not res["samples"] else str(exc)
        log_line(f"{res['key']}: {exc}" + ("; trying a new job" if res["retry"] else ""))
        job.close()
        return False
    except BaseException:
        job.close()
        raise


# -- rows ---------------------------------------------------------------------------------------------------------

def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rows_of(results: list[dict]) -> list[dict]:
    ways = {w.key: w for w in WAYS}
    rows = []
    for res in results:
        way = ways[res.get("way", res["key"])]
        pre = prefix(res.get("hosts", 1))
        samples = res["samples"]
        values = [s["seconds"] for s in samples]
        what = "SIGKILLed" if way.fault == "kill" else "raises"
        on = "" if not pre else f" ({res['hosts']} hosts)"
        compiled = ", torch.compile'd model" if "--compile" in way.worker_args else ""
        row = {"key": res["key"], "label": f"fault -> training{on}, a rank {what}{compiled}: {way.label}",
               "unit": "s", "values": values, "median": _med(values), "vs": pre + VS[way.key.split(".")[0]],
               "world_after": [s["world_after"] for s in samples],
               "pids_kept": [f"{s['pids_kept']} of {s['survivors']}" for s in samples],
               "jobs_ended": f"{sum(all(c is not None for c in codes) for codes in res['exit_codes'])} of "
                             f"{len(res['exit_codes'])}", "exit_codes": res["exit_codes"],
               "note": res["note"], "target": TARGET if way.key.split(".")[0] in ("kill", "raise")
                                                      and ".elaunch_inprocess" in way.key else None}
        rows.append(row)
        if compiled:
            rows += _compile_rows(res, way, on)
    by = {r["key"]: r for r in rows}
    for r in rows:
        base = by.get(r["vs"])
        r["ratio"] = (r["median"] / base["median"]) if base and base["median"] and r["median"] is not None else None
        t = r["target"]
        r["met"] = None if not t else bool(r["median"] is not None and r["median"] <= t["value"]
                                            and all(w == NPROC for w in r["world_after"]))
    return rows


def _compile_rows(res: dict, way: Way, on: str) -> list[dict]:
    """The first forward after each fault (torch.compile's cost: dynamo and inductor, before any collective), the
    slowest of the processes kept and of the processes started anew, as two rows."""
    rows = []
    for which, pick in (("kept processes", True), ("new processes", False)):
        values = []
        for s in res["samples"]:
            fwd = [v for r, v in s.get("first_fwd_s", {}).items() if v is not None and (int(r) in s["kept_ranks"]) == pick]
            values.append(max(fwd) if fwd else None)
        values = [v for v in values if v is not None]
        rows.append({"key": f"{res['key']}.first_forward_{'kept' if pick else 'new'}",
                     "label": f"first forward after the fault{on} (torch.compile), {which}: {way.label}", "unit": "s",
                     "values": values, "median": _med(values), "vs": "", "world_after": [], "pids_kept": [],
                     "jobs_ended": "", "exit_codes": [], "note": None if values else "none", "target": None})
    return rows


def fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def markdown(rows: list[dict]) -> str:
    lines = ["| row | median (n) | ratio | world after | survivors' processes kept | jobs ended by themselves | "
             "target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = len(r["values"])
        ratio = f"{r['ratio']:.2f}× {r['vs'].rsplit('.', 1)[1]}" if r["ratio"] is not None else ""
        med = fmt(r["median"]) + f" (n={n})" if r["median"] is not None else (r["note"] or "—").replace("|", "/")
        worlds = ", ".join(sorted({str(w) for w in r["world_after"]})) or "—"
        kept = ", ".join(sorted(set(r["pids_kept"]))) or "—"
        target = "" if not r["target"] else f"{r['target']['text']}: {'met' if r['met'] else 'not met'}"
        lines.append(f"| {r['label']} | {med} | {ratio} | {worlds} | {kept} | {r['jobs_ended']} | {target} |")
    return "\n".join(lines)


def _netns_unavailable() -> str | None:
    from tests.multinode import netns

    reason = netns.unavailable_reason()
    if reason is None:
        netns.cleanup_stale()
    return reason


def _nvrx_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-resiliency-ext")
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one fault a way, a small model (a smoke run, ~3 min)")
    p.add_argument("--json", type=Path, default=None, help="write meta, rows and raw samples here")
    p.add_argument("--only", default=None, help="comma-separated row keys or prefixes (kill, raise.nvrx, ...)")
    p.add_argument("--reps", type=int, default=None, help="faults a way (default 5, --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hosts", default="1", help="comma-separated: 1 (this machine, --standalone), 3 (3 network-namespace "
                                                "hosts, one agent and one worker each); default 1")
    p.add_argument("--work-dir", type=Path, default=None, help="keep logs here (default: a temporary directory)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: nccl, the model on the GPU (ranks may share one GPU: scripts/gpu_shared.py); "
                        "default cpu (gloo)")
    p.add_argument("--agent-args", default="", metavar="FLAGS",
                   help="more flags for elaunch's agents, space-separated (e.g. --inprocess-timeout=8)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from benchmarks import run as suite

    s = QUICK if a.quick else FULL
    if a.reps:
        s = Sizes(**{**asdict(s), "reps": a.reps})
    only = [x for x in (a.only or "").split(",") if x]
    ways = [w for w in WAYS if not only or any(w.key == o or w.key.startswith(o + ".") for o in only)]
    t_begin, load_start = time.monotonic(), suite._loadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="elaunch-inprocess-") as tmp:
        root = a.work_dir.resolve() if a.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for hosts in [int(h) for h in a.hosts.split(",") if h]:
            if hosts not in (1, NPROC):
                p.error(f"--hosts: {hosts}: expected 1 or {NPROC}")
            reason = None if hosts == 1 else _netns_unavailable()
            for way in ways:
                log_line(f"{prefix(hosts)}{way.key}: {way.label}")
                if reason:
                    results.append({"key": prefix(hosts) + way.key, "way": way.key, "hosts": hosts, "samples": [],
                                    "note": f"not run: {reason}", "exit_codes": []})
                    continue
                results.append(run_way(way, s, root, a.seed, hosts, a.device, tuple(a.agent_args.split())))
    rows = rows_of(results)
    torch_v, elaunch_v = suite._versions()
    meta = {"command": "python -m benchmarks.inprocess" + ("" if len(sys.argv) < 2 else " " + " ".join(sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": suite._machine(), "torch": torch_v,
            "elaunch": elaunch_v, "nvidia_resiliency_ext": _nvrx_version(), "commit": suite._commit(),
            "loadavg_start": load_start, "loadavg_end": suite._loadavg(), "duration_s": time.monotonic() - t_begin,
            "quick": a.quick, "sizes": asdict(s), "nproc": NPROC, "hosts": a.hosts, "device": a.device,
            "agent_args": a.agent_args,
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))},
            "notes": [f"process groups: {'nccl' if a.device == 'cuda' else 'gloo'}; init_process_group's timeout "
                      f"{s.pg_timeout:g} s in the raise rows (the "
                      f"same for elaunch and NVRx), {s.pg_timeout_kill:g} s in the kill rows (a restarted group's "
                      "first collectives wait for its slowest worker, importing torch cold)"]}
    emit(meta, rows, results, a.json, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
