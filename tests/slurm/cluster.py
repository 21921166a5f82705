"""A real Slurm cluster on this machine: slurmctld and one slurmd per node, each in a test host.

Test hosts are network namespaces on a bridge (``tests/multinode/netns.py``). The
controller host (``192.168.77.1``, hostname ``ctl``) runs munged and slurmctld; each
node host (``192.168.77.2``, ``.3``, ...; hostnames ``node1``, ``node2``, ...) runs a
slurmd inside its own UTS namespace (``unshare --uts``), so the slurmd finds its
node name in its hostname as on a real cluster, and every job step it starts runs
in that host: an elaunch agent started by ``srun`` binds its node's address.

Names resolve as on a cluster: each daemon runs in a mount namespace of its own
where a ``hosts`` file naming the controller and every node is bind-mounted over
``/etc/hosts`` (the daemons enter their host with ``nsenter --net``, not ``ip netns
exec``, whose fresh ``/sys`` has no ``/sys/fs/cgroup``, without which slurmd
refuses to start even with ``proctrack/linuxproc``).

Everything else lives in a temporary directory: the munge key (generated), the
munge socket (a path socket: reachable from every namespace), ``slurm.conf``,
the controller's state, each node's spool, and the daemons' logs. Client
commands (``sbatch``, ``scancel``, ...) run in the controller host with
``SLURM_CONF`` pointing at that ``slurm.conf`` (:meth:`SlurmCluster.client`).

Needs root, ``ip``, ``nsenter``, ``unshare`` and Debian's slurmctld, slurmd, slurm-client and
munge (``scripts/install-slurm.sh``); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from tests.multinode import netns

#: Commands the cluster needs, and the package each comes from.
COMMANDS = {
    "munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
    "squeue": "slurm-client", "scancel": "slurm-client", "sinfo": "slurm-client", "unshare": "util-linux",
    "nsenter": "util-linux",
}
CONTROLLER = "ctl"
CTLD_PORT = 6817
SLURMD_PORT = 6818

SLURM_CONF = """\
# written by tests/slurm/cluster.py
ClusterName=elaunch-test
SlurmctldHost={controller}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={base}/ctld-state
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdSpoolDir={base}/spool/%n
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmdLogFile={base}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no systemd and no cgroup delegation here: a step's processes are its task's
# process tree (/proc parent links); no binding of tasks to CPUs
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# SIGKILL this long after scancel's SIGTERM (default 30 s)
KillWait={kill_wait}
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=test Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here (one line), or None if it can."""
    missing = sorted({pkg for cmd, pkg in COMMANDS.items() if shutil.which(cmd) is None})
    if missing:
        return f"Slurm is not installed (missing packages: {', '.join(missing)}; run scripts/install-slurm.sh)"
    return netns.unavailable_reason()


class SlurmError(RuntimeError):
    """A Slurm daemon did not start, or a client command failed.

    Attributes:
        summary: one line saying what failed (a test's skip reason).
        details: the daemons' logs or the command's output, for the full message.
    """

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(f"{summary}\n{details}" if details else summary)
        self.summary = summary
        self.details = details


class SlurmCluster:
    """munged + slurmctld in a controller host, one slurmd per node host; use as a context manager.

    Args:
        base: an empty directory for keys, configuration, state and logs.
        nodes: number of compute nodes (>= 1).
        cpus: CPUs each node declares (``CPUs=`` in slurm.conf; they share this machine's).
        kill_wait: Slurm's ``KillWait``, seconds between a cancel's SIGTERM and SIGKILL.

    Raises:
        SlurmError: a daemon exited or did not come up within ``start_timeout`` s
            (from :meth:`start`); everything started so far is stopped first.
    """

    def __init__(self, base: Path, nodes: int = 2, cpus: int = 2, kill_wait: int = 10) -> None:
        self.base = Path(base)
        self.n_nodes = nodes
        self.cpus = cpus
        self.kill_wait = kill_wait
        self.net: netns.Network | None = None
        self.ctl: netns.Host | None = None
        self.nodes: dict[str, netns.Host] = {}
        self.daemons: dict[str, subprocess.Popen] = {}
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "run" / "munge.socket"
        self.hosts_file = self.base / "hosts"

    # -- set-up ---------------------------------------------------------------------------

    def start(self, start_timeout: float = 60.0) -> SlurmCluster:
        """Build the hosts, write the files, start the daemons, wait until every node is idle."""
        try:
            self._build_hosts()
            self._write_files()
            self._start_daemons(start_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _build_hosts(self) -> None:
        self.net = netns.Network("-slurm")
        self.ctl = self.net.add_host()
        self.ctl.service = True
        for i in range(1, self.n_nodes + 1):
            self.nodes[f"node{i}"] = self.net.add_host()

    def _write_files(self) -> None:
        for sub, mode in (("munge", 0o700), ("run", 0o755), ("log", 0o755), ("ctld-state", 0o755),
                          ("spool", 0o755)):
            (self.base / sub).mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(self.base / sub, mode)  # munged refuses group/other-writable directories
        for name in self.nodes:
            (self.base / "spool" / name).mkdir(exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{self.ctl.addr} {CONTROLLER}"]
        lines += [f"{h.addr} {name}" for name, h in self.nodes.items()]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(f"NodeName={name} NodeAddr={h.addr} CPUs={self.cpus} State=UNKNOWN"
                          for name, h in self.nodes.items())
        self.conf.write_text(SLURM_CONF.format(
            controller=CONTROLLER, ctl_addr=self.ctl.addr, ctld_port=CTLD_PORT, slurmd_port=SLURMD_PORT,
            munge_socket=self.munge_socket, base=self.base, kill_wait=self.kill_wait, nodes=nodes,
            node_names=",".join(self.nodes)))

    def host_cmd(self, host: netns.Host, hostname: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in ``host``'s network namespace as machine ``hostname``.

        New UTS and mount namespaces (``unshare``): the hostname is ``hostname`` and
        ``/etc/hosts`` is the cluster's. Every wrapper execs, so the pid is argv's own.
        """
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{host.ns}", "--", "unshare", "--uts", "--mount", "--",
                "sh", "-c", script, str(self.hosts_file), hostname, *argv]

    def _spawn(self, name: str, host: netns.Host, argv: Sequence[str], hostname: str) -> None:
        """Start daemon ``name`` (in the foreground) inside ``host`` as machine ``hostname``."""
        with open(self.base / "log" / f"{name}.out", "w") as log:
            self.daemons[name] = subprocess.Popen(self.host_cmd(host, hostname, argv), stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  env=self.env())

    def _start_daemons(self, timeout: float) -> None:
        base = self.base
        self._spawn("munged", self.ctl, [
            "munged", "-F", "--force", f"--key-file={base / 'munge' / 'munge.key'}",
            f"--socket={self.munge_socket}", f"--pid-file={base / 'run' / 'munged.pid'}",
            f"--seed-file={base / 'munge' / 'munged.seed'}", f"--log-file={base / 'log' / 'munged.log'}",
        ], CONTROLLER)
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged to create its socket")
        self._spawn("slurmctld", self.ctl, ["slurmctld", "-D", "-i", "-f", str(self.conf)], CONTROLLER)
        for name, host in self.nodes.items():
            self._spawn(f"slurmd-{name}", host, ["slurmd", "-D", "-f", str(self.conf)], name)
        self._wait(self._all_idle, timeout, "every node to be idle in sinfo")

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                if dead:
                    name, code = next(iter(dead.items()))
                    why = f"{name} exited ({code}): {self._last_error(name)}"
                else:
                    why = f"timed out after {timeout} s"
                raise SlurmError(f"waiting for {what}: {why}", self.logs())
            time.sleep(0.1)

    def _last_error(self, daemon: str) -> str:
        """The last line of ``daemon``'s output that says ``error`` (or its last line)."""
        path = self.base / "log" / f"{daemon}.out"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        errors = [line for line in lines if "error" in line.lower()]
        return (errors or lines or ["no output"])[-1].strip()

    def _all_idle(self) -> bool:
        res = self.client(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    # -- use ------------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` set (and ``extra``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def client(self, argv: Sequence[str], env: dict | None = None, check: bool = True,
               timeout: float = 30.0, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
        """Run a client command (``sbatch ...``) in the controller host, in ``cwd``; text output captured.

        ``env`` defaults to :meth:`env` (it must hold ``SLURM_CONF``); ``timeout`` in seconds.

        Raises:
            SlurmError: ``check`` and it exits non-zero (its stderr in the message).
        """
        res = subprocess.run(self.host_cmd(self.ctl, CONTROLLER, argv), capture_output=True, text=True, timeout=timeout,
                             env=env or self.env(), cwd=cwd)
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}", self.logs())
        return res

    def job_state(self, job_id: str) -> str | None:
        """The job's state (``RUNNING``, ``COMPLETED``, ``CANCELLED``...) per squeue; None once it is gone."""
        res = self.client(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"], check=False)
        return res.stdout.strip() or None

    def node_pids(self) -> list[int]:
        """Pids in the node hosts other than the slurmds themselves (job steps and what they started)."""
        daemons = {p.pid for p in self.daemons.values()}
        found = []
        for pid in (pid for h in self.nodes.values() for pid in h.pids() if pid not in daemons):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # PID 1 here may not reap
                    found.append(pid)
            except psutil.Error:
                pass
        return found

    def logs(self, tail: int = 3000) -> str:
        """The end of every daemon log, for failure messages."""
        out = []
        for path in sorted((self.base / "log").glob("*")):
            out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    # -- tear-down ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the daemons (SIGTERM, then SIGKILL), kill what runs in the hosts, delete them and the files."""
        procs = []
        for p in self.daemons.values():
            if p.poll() is None:
                p.terminate()
            procs.append(p)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self.net is not None:
            self.net.close()  # SIGKILLs anything left in the hosts (job steps included)
            self.net = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def stray_job_processes(job_id: str) -> dict[int, str]:
    """Every process on this machine whose environment says it belongs to Slurm job ``job_id``.

    Returns:
        pid -> command line, for processes with ``SLURM_JOB_ID=<job_id>`` in their environ.
    """
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("SLURM_JOB_ID") == str(job_id) and p.status() != psutil.STATUS_ZOMBIE:
                found[p.pid] = " ".join(p.info["cmdline"] or [])[:200]
        except psutil.Error:
            pass
    return found
