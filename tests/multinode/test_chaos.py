"""Chaos: one training run on three test hosts survives five faults in a row (c10d, etcd-v3).

examples/ddp_digits.py runs on hosts h1, h2, h3 (network namespaces, 2 workers
each; the c10d store lives in h1's agent, etcd in a host of its own) with
``--nnodes=1:3``. Each fault is injected only once the previous one was handled,
that is once the job runs again in the expected world (restart count included,
where it must change) and that world wrote a checkpoint:

1. a worker crash: rank 3 raises (``--crash-at`` on attempt 0); restart 1;
2. a hung worker: a worker of h2 gets SIGSTOP; ``--hang-timeout`` finds it, every
   node dumps its workers' stacks, the hung worker is SIGKILLed; restart 2;
3. a preemption notice (SIGUSR1 to h3's agent, forwarded: rank 0 checkpoints),
   then SIGTERM to h3's agent: h3 leaves, h1 and h2 go on in a world of 4; then a
   new agent on h3 (the host came back) grows the world to 6 again;
4. ``kill -9`` of h2's agent (h2 does not hold the store): a world of 4 (h1, h3);
5. h3's link is cut: a world of 2 (h1); h3's agent gives up within its timeouts.

The job then finishes with test accuracy >= 0.95, every fault is named in the
agents' logs, and no process is left in any host. The run happens once per
backend (a module fixture, about 2 minutes; ``timeline.txt`` in its directory
says when each fault was handled); the tests below each check one part of it.
The xfail one names what the agents are still seen to get wrong (a killed host is charged as a
worker failure, not named as a lost node: the node-loss work of the speed issue).
"""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.conftest import EXAMPLES, NOT_APPLICABLE, wait_for
from tests.multinode import netns
from tests.multinode.conftest import (
    Agent,
    Rendezvous,
    agent_args,
    etcd_unavailable_reason,
    no_processes_in,
    worker_envs,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

#: enough that the five faults land before the last epoch (about 4 are done by then:
#: every world size change restarts the epoch), and few enough to finish soon on h1 alone
EPOCHS = 10
CRASH = (3, 2, 2)  # rank 3 raises before step 2 of epoch 2, on attempt 0
SCRIPT = [str(EXAMPLES / "ddp_digits.py"), "--lr", "0.005", "--epochs", str(EPOCHS), "--step-sleep", "0.1",
          "--save-every", "4", "--crash-at", ":".join(map(str, CRASH))]
HANG_TIMEOUT = 8  # well above the keep-alive's loss detection (1 s x 3): a cut-off host is not taken for a hang
MAX_RESTARTS = 20
#: exclude_after=0: no node sits out for causing failures in a row (the world sizes are the test's)
CONF = "read_timeout=10,exclude_after=0"
#: seconds for one fault to be handled: detection, re-form, workers started, a checkpoint written
HANDLED = 90
FAULTS = ("crash", "hang", "notice", "sigterm", "rejoin", "kill9", "cut")


@dataclass
class Chaos:
    """One chaos run: its agents, and the agents' stderr lines written while each fault was handled."""

    backend: str
    tmp: Path
    agents: dict[str, Agent] = field(default_factory=dict)
    segments: dict[str, str] = field(default_factory=dict)  # fault -> "[agent] line" lines
    timeline: list[tuple[str, float]] = field(default_factory=list)  # (fault handled, seconds since start)
    codes: dict[str, int] = field(default_factory=dict)  # agent -> exit code
    stopped_rank: int = -1  # the SIGSTOPped worker's global rank
    leftovers: str = ""  # processes left in the hosts at the end (empty: none)
    _marks: dict[str, dict[str, int]] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic)

    def mark(self, fault: str) -> None:
        self._marks[fault] = {n: len(a.stderr) for n, a in self.agents.items()}

    def close(self, fault: str) -> None:
        start = self._marks[fault]
        self.segments[fault] = "\n".join(f"[{n}] {line}" for n, a in self.agents.items()
                                         for line in a.stderr[start.get(n, 0):].splitlines())
        self.timeline.append((fault, round(time.monotonic() - self._t0, 1)))

    def stdout(self) -> str:
        return "".join(a.stdout for a in self.agents.values())

    def describe(self) -> str:
        return f"{self.backend}: handled {self.timeline}\n" + "\n".join(a.describe() for a in self.agents.values())


def _worker(host: netns.Host, local_rank: int) -> tuple[psutil.Process, dict[str, str]]:
    """The elaunch worker of ``host`` with ``local_rank``, and its environment."""
    for pid in host.pids():
        try:
            p = psutil.Process(pid)
            env = p.environ()
        except psutil.Error:
            continue
        if "TORCHELASTIC_RUN_ID" in env and env.get("LOCAL_RANK") == str(local_rank):
            return p, env
    raise AssertionError(f"no worker with local rank {local_rank} in {host}")


def _play(run: Chaos, net: netns.Network, rdzv: Rendezvous) -> None:
    """Start the job on three hosts and inject the five faults, each once the previous one was handled."""
    h1, h2, h3 = net.add_host(), net.add_host(), net.add_host()
    ep = rdzv.endpoint(h1)
    ck = run.tmp / "ck.pt"

    def start(host: netns.Host, name: str) -> Agent:
        extra = (f"--max-restarts={MAX_RESTARTS}", f"--hang-timeout={HANG_TIMEOUT}",
                 f"--log-dir={run.tmp / 'logs' / name}")
        argv = agent_args(host, ep, backend=rdzv.backend, nnodes="1:3", conf=CONF, extra=extra)
        run.agents[name] = Agent(host, argv + [*SCRIPT, "--checkpoint", str(ck)], run.tmp, name)
        return run.agents[name]

    def training(hosts, alive, restarts=None, what=""):
        """Wait until ``hosts`` run a world of 2 x len(hosts) (at ``restarts``) that wrote a checkpoint since."""
        size = str(2 * len(hosts))

        def running():
            dead = [a for a in alive if a.proc.poll() is not None]
            assert not dead, f"{dead} exited while waiting for {what}"
            for h in hosts:
                envs = worker_envs(h)
                if len(envs) != 2 or {e["WORLD_SIZE"] for e in envs} != {size}:
                    return False
                if restarts is not None and {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} != {str(restarts)}:
                    return False
            return True

        try:
            wait_for(running, HANDLED, interval=0.2, what=f"a world of {size} ({what})")
            since = time.time()
            wait_for(lambda: running() and ck.exists() and ck.stat().st_mtime > since, HANDLED, interval=0.2,
                     what=f"a checkpoint from the world of {size} ({what})")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{run.describe()}") from None
        assert "final test accuracy" not in run.stdout(), (
            f"the job finished before all faults were injected ({what}): raise EPOCHS\n{run.describe()}")

    a1, a2, a3 = start(h1, "a1"), start(h2, "a2"), start(h3, "a3")

    # 1. a worker crash: rank 3 raises (attempt 0 only)
    run.mark("crash")
    training((h1, h2, h3), (a1, a2, a3), restarts=1, what="restarted after the crash")
    run.close("crash")

    # 2. a hung worker: SIGSTOP h2's local rank 1
    run.mark("hang")
    stopped, env = _worker(h2, local_rank=1)
    run.stopped_rank = int(env["RANK"])
    stopped.send_signal(signal.SIGSTOP)
    training((h1, h2, h3), (a1, a2, a3), restarts=2, what="restarted after the hang")
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE, "the hung worker still exists"
    run.close("hang")

    # 3. preemption of h3: a notice (forwarded; rank 0 checkpoints), then SIGTERM: h3 leaves
    run.mark("notice")
    a3.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: re.search(r"preemption notice \(SIGUSR1\): checkpoint saved", run.stdout()), 30,
             interval=0.1, what="the notice's checkpoint")
    run.close("notice")
    run.mark("sigterm")
    a3.proc.send_signal(signal.SIGTERM)
    run.codes["a3"] = a3.wait(30)
    no_processes_in([h3], timeout=20)
    training((h1, h2), (a1, a2), what="h3 preempted")
    run.close("sigterm")
    run.mark("rejoin")
    a3b = start(h3, "a3b")  # the host came back
    training((h1, h2, h3), (a1, a2, a3b), what="h3 rejoined")
    run.close("rejoin")

    # 4. kill -9 of h2's agent: its workers die with it; h1 and h3 go on
    run.mark("kill9")
    a2.kill9()
    run.codes["a2"] = a2.proc.returncode
    no_processes_in([h2], timeout=20)
    training((h1, h3), (a1, a3b), what="h2's agent killed")
    run.close("kill9")

    # 5. h3's link is cut: h1 goes on alone; h3's agent gives up within its timeouts
    run.mark("cut")
    h3.link_down()
    cut_at = time.monotonic()
    training((h1,), (a1,), what="h3 cut off")
    run.close("cut")

    run.codes["a1"] = a1.wait(240)
    run.timeline.append(("finished", round(time.monotonic() - run._t0, 1)))
    run.codes["a3b"] = a3b.wait(max(1.0, 120 - (time.monotonic() - cut_at)))
    run.timeline.append(("the cut-off agent exited, after the cut", round(time.monotonic() - cut_at, 1)))
    no_processes_in([h3], timeout=20)
    (run.tmp / "timeline.txt").write_text("".join(f"{what}: {t} s\n" for what, t in run.timeline))
    try:
        no_processes_in(net.hosts)
    except AssertionError as exc:
        run.leftovers = str(exc)


@pytest.fixture(scope="module", params=["c10d", "etcd-v3"])
def chaos(request, _netns_ready, tmp_path_factory) -> Chaos:
    """The chaos run on ``request.param``'s rendezvous (done once; everything is removed afterwards)."""
    backend = request.param
    if backend != "c10d":
        reason = etcd_unavailable_reason(backend)
        if reason:
            pytest.skip(f"{backend}: {reason}")
    tmp = tmp_path_factory.mktemp(f"chaos-{backend}")
    net = netns.Network()
    rdzv = Rendezvous(backend, net, tmp)
    run = Chaos(backend, tmp)
    try:
        _play(run, net, rdzv)
        yield run
    finally:
        for a in run.agents.values():
            if a.proc.poll() is None:
                a.proc.kill()
                a.proc.wait(timeout=10)
        rdzv.stop()
        net.close()


def _restart_lines(run: Chaos) -> dict[int, set[int]]:
    """restart n -> the root-cause ranks the agents' "worker group failed (rank R ...); restart n/m" lines name."""
    named: dict[int, set[int]] = {}
    for a in run.agents.values():
        for rank, n in re.findall(r"worker group failed \(rank (\d+) on [^)]*\); restart (\d+)/", a.stderr):
            named.setdefault(int(n), set()).add(int(rank))
    return named


def test_the_job_survives_the_five_faults_and_reaches_its_accuracy(chaos):
    assert chaos.codes["a1"] == 0, chaos.describe()
    assert chaos.codes["a3"] == 128 + signal.SIGTERM, chaos.describe()  # left by SIGTERM
    assert chaos.codes["a2"] == -signal.SIGKILL  # the kill -9
    assert chaos.codes["a3b"] != 0, chaos.describe()  # cut off: gave up
    out = chaos.agents["a1"].stdout  # h1 ran rank 0 at the end
    assert f"epoch {EPOCHS}/{EPOCHS}" in out, chaos.describe()
    acc = re.findall(r"final test accuracy: ([0-9.]+)", out)
    assert acc and float(acc[-1]) >= 0.95, out[-3000:]
    assert not chaos.leftovers, chaos.leftovers


def test_every_fault_is_named_in_the_logs(chaos):
    seg = chaos.segments
    rank, epoch, step = CRASH
    assert f"injected crash: rank {rank} at epoch {epoch} step {step} on attempt 0" in seg["crash"], seg["crash"]
    assert re.search(rf"worker group failed \(rank {rank} on .*\); restart 1/", seg["crash"]), seg["crash"]
    assert re.search(r"HUNG: .*made no progress for [0-9.]+ s", seg["hang"]), seg["hang"]
    assert re.search(r"exitcode -9 SIGKILL\); restart 2/", seg["hang"]), seg["hang"]
    assert re.search(r"\[a3\] .*received SIGUSR1: forwarded to the workers", seg["notice"]), seg["notice"]
    assert re.search(r"\[a3\] .*received SIGTERM, stopping workers", seg["sigterm"]), seg["sigterm"]
    assert re.search(r"\[(a1|a2)\] .*(membership changed \(1 node\(s\) waiting to join|1 new node\(s\) joined)",
                     seg["rejoin"]), seg["rejoin"]
    # the survivors re-form (as a membership change, or after their workers failed on the closed sockets)
    # the killed host is named: the next round formed without it (its agent's node id starts with its address)
    h2 = re.escape(chaos.agents["a2"].host.addr)
    assert re.search(rf"\[(a1|a3b)\] .*formed without 1 node\(s\) of round \d+: {h2}_", seg["kill9"]), seg["kill9"]
    for fault, survivors in (("sigterm", "a1|a2"), ("kill9", "a1|a3b"), ("cut", "a1")):
        assert re.search(rf"\[({survivors})\] .*(membership changed|worker group failed)", seg[fault]), (
            fault, seg[fault])
    assert re.search(r"\[a1\] .*membership changed \(\d+ node\(s\) waiting to join, 1 lost\)", seg["cut"]), seg["cut"]
    assert "elaunch: rendezvous failed: " in chaos.agents["a3b"].stderr, chaos.describe()  # why it gave up


def test_every_node_dumped_its_stacks_for_the_hang(chaos):
    for name in ("a1", "a2", "a3"):
        stacks = list((chaos.tmp / "logs" / name).rglob("stacks/*.txt"))
        assert stacks, (name, chaos.segments["hang"])
    text = "".join(p.read_text() for p in (chaos.tmp / "logs" / "a2").rglob("stacks/*.txt"))
    assert "local rank 1 (pid " in text, text  # the stopped worker's own stacks
    assert re.search(r"local rank 1 \(pid \d+, STOPPED", text), text  # marked as stopped


def test_each_failure_is_counted_once_for_the_job(chaos):
    named = _restart_lines(chaos)
    # crash and hang each counted once (the workers' TORCHELASTIC_RESTART_COUNT was 1, then 2);
    # the others (SIGTERM'd workers, closed sockets) may count, but never twice
    assert 1 in named and 2 in named, named
    assert sorted(named) == list(range(1, max(named) + 1)), named
    assert max(named) <= 5, named


def test_the_hang_is_blamed_on_the_stopped_worker(chaos):
    named = _restart_lines(chaos)
    assert named[2] == {chaos.stopped_rank}, (named, chaos.stopped_rank, chaos.segments["hang"])
    # which node's request the others answered first is a race (a node whose ranks only wait
    # behind the stopped one may ask first); what must hold is the root cause above


def test_the_agents_agree_on_each_restart_root_cause(chaos):
    named = _restart_lines(chaos)
    assert all(len(ranks) == 1 for ranks in named.values()), named


def test_a_killed_host_is_seen_as_lost(chaos):
    seg = chaos.segments["kill9"]
    assert re.search(r"membership changed \(\d+ node\(s\) waiting to join, 1 lost\)", seg), seg
    assert "worker group failed" not in seg, seg


def test_no_raw_grpc_error_reaches_the_user(chaos):
    if chaos.backend != "etcd-v3":
        pytest.skip(f"{NOT_APPLICABLE} gRPC is etcd-v3's transport")
    for name, a in chaos.agents.items():
        assert "_InactiveRpcError" not in a.stderr and "_MultiThreadedRendezvous" not in a.stderr, a.describe()


def test_the_run_draws_as_one_timeline_with_every_fault(chaos):
    # the agents' event logs (one per --log-dir) drawn as one picture: a lane per agent,
    # and the faults as marks (restarts, membership changes, the hang, the notice)
    import xml.etree.ElementTree as ET

    from elaunch.timeline import main as timeline

    logs = sorted(str(p) for p in (chaos.tmp / "logs").iterdir())
    out = chaos.tmp / "timeline.svg"
    assert timeline([*logs, "-o", str(out)]) == 0
    svg = out.read_text()
    ET.fromstring(svg)  # well-formed
    for name in ("a1", "a2", "a3"):
        events = list((chaos.tmp / "logs" / name).rglob("events.jsonl"))
        assert events, name
    kinds = {json.loads(line)["kind"] for p in (chaos.tmp / "logs").rglob("events.jsonl")
             for line in p.read_text().splitlines()}
    assert {"restart", "membership_change", "hang", "notice"} <= kinds, kinds
