"""In-process restart (issue 37) with real processes, real signals and gloo: ``@elaunch.restartable``.

One small restartable training (``tests/scripts/restartable_train.py``, 3 ranks, a checkpoint
each step) run uninterrupted under torchrun (the reference: the wrapper is then plain
``main()``), then under elaunch with a SIGKILLed rank, a raising rank, and undecorated.
"""

from __future__ import annotations

import json
import signal
import os
import sys
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.helpers import SCRIPTS, finish_agents, free_port, launcher_env, run, start, start_agent

pytestmark = pytest.mark.slow

SCRIPT = str(SCRIPTS / "restartable_train.py")
JOB = ("--standalone", "--nproc-per-node=3", "--max-restarts=1")
#: The process group's timeout in the scripts, seconds: a survivor left waiting for it would miss every deadline here.
PG_TIMEOUT = "60"


def _rounds(out: Path) -> dict[int, list[dict]]:
    """Restart count -> the records of main()'s calls of that round, by rank."""
    rounds: dict[int, list[dict]] = {}
    for path in sorted(out.glob("round_*.json")):
        rec = json.loads(path.read_text())
        rounds.setdefault(rec["restarts"], []).append(rec)
    return {k: sorted(v, key=lambda r: r["rank"]) for k, v in rounds.items()}


def _events(log_dir: Path) -> list[dict]:
    (path,) = log_dir.glob("*/events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _digest(out: Path) -> str:
    return json.loads((out / "final.json").read_text())["sha256"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The final parameters' SHA-256 of the uninterrupted job under torchrun (restartable is plain main() there)."""
    out = tmp_path_factory.mktemp("torchrun")
    r = run("torchrun", "--standalone", "--nproc-per-node=3", SCRIPT, str(out), "--timeout", PG_TIMEOUT, cwd=out,
            timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    rounds = _rounds(out)
    assert list(rounds) == [0] and [r["start"] for r in rounds[0]] == [0, 0, 0]  # one plain call of main() per rank
    return _digest(out)


def test_torchrun_and_no_launcher_call_main_once(reference, tmp_path):
    """Under torchrun (the fixture) and with no launcher at all, the decorated main() runs once, plainly."""
    env = launcher_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--steps", "3"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = _rounds(tmp_path)[0]
    assert (rec["world"], rec["start"]) == (1, 0)
    assert "control channel" not in r.stderr


def test_sigkill_replaces_only_the_dead_rank(reference, tmp_path):
    """SIGKILL of rank 1: ranks 0 and 2 keep their processes, a new one takes rank 1, world size 3,
    every rank resumes after the agreed step, and the final parameters equal the uninterrupted run's."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    r = run("elaunch", *JOB, "--log-dir", str(logs), SCRIPT, str(out), "--kill", "1:5", "--timeout", PG_TIMEOUT,
            timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker group failed (rank 1 on" in r.stderr and "SIGKILL); restart 1/1" in r.stderr  # the root cause
    rounds = _rounds(out)
    before, after = rounds[0], rounds[1]
    assert [a["pid"] == b["pid"] for a, b in zip(before, after)] == [True, False, True]
    assert [a["world"] for a in after] == [3, 3, 3]
    assert len({a["start"] for a in after}) == 1 and after[0]["start"] >= 5  # the step the job agreed on, + 1
    assert _digest(out) == reference
    events = _events(logs)
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["counted"] and restart["count"] == 1
    (inproc,) = [e for e in events if e["kind"] == "inprocess_restart"]
    assert (inproc["kept"], inproc["started"]) == ([0, 2], [1])


def test_raising_rank_restarts_in_place_without_waiting_for_the_timeout(reference, tmp_path):
    """A rank whose main() raises: its peers' collectives end at once (not at the 60 s gloo timeout),
    the failure is counted, and all three processes run the next round."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, SCRIPT, str(out), "--raise", "1:5", "--timeout", PG_TIMEOUT, timeout=40)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker group failed (rank 1" in r.stderr and "restart 1/1" in r.stderr
    assert "planted fault on rank 1" in r.stderr  # its traceback, as an uncaught exception prints it
    rounds = _rounds(out)
    assert [a["pid"] for a in rounds[0]] == [a["pid"] for a in rounds[1]]
    fault = json.loads((out / "fault.json").read_text())
    assert max(a["started"] for a in rounds[1]) - fault["at"] < 10.0  # seconds: far below the 60 s timeout
    assert _digest(out) == reference


@pytest.mark.parametrize("fault", ["--kill", "--raise"])
def test_a_process_group_whose_destroy_fails_is_ended_all_the_same(reference, tmp_path, fault):
    """The last round's destroy_process_group raises in every process (as NCCL's shutdown of a communicator the
    fault broke did on a GPU): the wrapper ends the group with torch's abort instead, and the next round's
    init_process_group builds a new one, so one restart suffices (before, every kept process failed again:
    "initialize the default process group twice")."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, SCRIPT, str(out), fault, "1:5", "--destroy-fails", "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "destroy_process_group: planted: the process group's shutdown failed" in r.stderr
    assert "twice" not in r.stderr and "restart 2/" not in r.stderr
    rounds = _rounds(out)
    assert sorted(rounds) == [0, 1]
    kept = [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])]
    assert kept == ([True, False, True] if fault == "--kill" else [True, True, True])
    assert _digest(out) == reference


def _fault_once_spares_are_forked(tmp_path: Path, local_ranks: int, *args: str, env: dict | None = None) -> tuple:
    """Run ``elaunch *args`` (``restartable_train.py`` with a ``--kill``) whose fault waits (``--wait-file``)
    until the next attempt's spares exist: a template per local rank and the spare each forked. Returns
    ``(exit code, stderr)``."""
    from tests.conftest import wait_for
    from tests.helpers import kill_tree, start

    go = tmp_path / "go"
    agent = start("elaunch", *args, "--wait-file", str(go), env=env)
    try:
        def spares_forked() -> bool:
            kids = psutil.Process(agent.pid).children()
            return sum("--template" in " ".join(k.cmdline()) for k in kids if k.is_running()) >= 2 * local_ranks

        wait_for(spares_forked, 60, what="the next attempt's spares, forked by their templates")
        go.touch()
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
    return agent.returncode, err


def test_a_survivor_not_ready_in_time_is_killed_and_replaced(reference, tmp_path):
    """Rank 1 is SIGKILLed while rank 2 sleeps where no interrupt lands: rank 2 is not ready within
    --inprocess-timeout (2 s; --shutdown-timeout stays at its 30 s), so its stacks are written to the log
    directory (where it hung) and it is killed and replaced like the dead one, both by --warm-start spares;
    rank 0 keeps its process. Each replacement is handed over as soon as its worker is dead (rank 1's at the
    kill, rank 2's at its kill), before the round forms, and waits there for the round's "go": rank 1's ran
    the script while the agent still waited for rank 2 to be ready. (The kill comes once the next attempt's
    spares were forked: before, a replacement was handed over only when the next attempt started.)"""
    out = tmp_path / "out"
    out.mkdir()
    code, err = _fault_once_spares_are_forked(
        tmp_path, 3, *JOB, "--inprocess-timeout=2", "--warm-start", "--warm-start-modules=torch", "--log-dir",
        str(tmp_path / "logs"), SCRIPT, str(out), "--kill", "1:5", "--block", "2:5", "--timeout", PG_TIMEOUT)
    assert code == 0, err[-3000:]
    assert "local rank(s) [2] not ready within 2.0 s; killing them (their stacks: " in err
    (stacks,) = (tmp_path / "logs").glob("*/stacks/restart*_inprocess_not_ready_*.txt")
    text = stacks.read_text()
    assert "did not say ready within 2 s of the abort" in text and "local rank 2" in text
    assert "restartable_train.py" in text and "main" in text  # where it was: blocked in main()'s sleep
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, False]
    assert [a["warm"] for a in rounds[1]] == [True, True, True]  # spares: the first attempt's and the replacements
    (restart,) = [e for e in _events(tmp_path / "logs") if e["kind"] == "inprocess_restart"]
    assert (restart["kept"], restart["started"], restart["prestarted"]) == ([0], [1, 2], [1, 2])
    fault = json.loads((out / "fault.json").read_text())
    assert rounds[1][1]["loaded"] < fault["at"] + 1.5  # rank 1's replacement ran while rank 2 had 2 s to be ready
    assert rounds[1][1]["started"] > fault["at"] + 2.0  # and called main() at the round's "go", after rank 2's kill
    assert _digest(out) == reference


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
def test_a_replacement_started_for_a_restart_that_does_not_come_is_killed(tmp_path):
    """--max-restarts=0 with a rendezvous that can re-form (c10d, --nnodes=1:2), so the next attempt's spares
    are ready: rank 1's SIGKILL hands its spare the dead worker's environment at once, then the job fails (no
    restart left). The job fails as before, with rank 1's SIGKILL as its root cause, and the replacement that
    waited for a round that never came is gone when the agent is (the agent kills it when it decides not to
    restart; had it not, the replacement's wrapper exits when the channel closes: with neither, it is left)."""
    out = tmp_path / "out"
    out.mkdir()
    code, err = _fault_once_spares_are_forked(
        tmp_path, 2, "--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf=last_call_timeout=0.1", "--max-restarts=0",
        "--warm-start", "--warm-start-modules=torch", SCRIPT, str(out), "--kill", "1:5", "--timeout", PG_TIMEOUT,
        env=launcher_env(LOGLEVEL="DEBUG"))
    assert code == 1, err[-3000:]
    assert "local rank 1's replacement" in err and "started before the round" in err, err[-3000:]
    early = int(err.split("local rank 1's replacement ")[1].split()[0])
    assert not psutil.pid_exists(early) or psutil.Process(early).status() == psutil.STATUS_ZOMBIE
    assert "exitcode  : -9 (pid:" in err  # the root cause: rank 1's SIGKILL, in torchrun's failure summary


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
@pytest.mark.parametrize("fault, kept", [(("--kill", "1:5"), [True, False, False]),
                                         (("--raise", "2:5"), [True, True, False])], ids=["peer-killed", "raised"])
def test_a_survivor_whose_abort_never_returns_costs_only_its_rank_and_the_ready_deadline(reference, tmp_path,
                                                                                         fault, kept):
    """Rank 2's wrapper never returns from ending its round's collectives (as a survivor's ``ncclCommAbort`` hung
    on a GPU): after rank 1's SIGKILL (its control thread hangs there, or its main() thread when its collective
    broke first), or after its own main() raised (its main() thread hangs there, after its "raised"). After
    --inprocess-timeout (2 s, against --shutdown-timeout's 30 s) its stacks are written, showing where it hangs,
    and it is killed and replaced; the others keep their processes and the job ends as the uninterrupted one.
    (Before, a "raised" counted as ready: the hung process was kept and handed its rank, and the next round
    waited for it until the process group's timeout.)"""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, "--inprocess-timeout=2", "--log-dir", str(tmp_path / "logs"), SCRIPT, str(out),
            *fault, "--abort-hangs", "2", "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "local rank(s) [2] not ready within 2.0 s; killing them (their stacks: " in r.stderr
    (stacks,) = (tmp_path / "logs").glob("*/stacks/restart*_inprocess_not_ready_*.txt")
    assert "_planted_abort_that_never_returns" in stacks.read_text()
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == kept
    restart = [e for e in _events(tmp_path / "logs") if e["kind"] == "inprocess_restart"]
    new = [lr for lr, k in enumerate(kept) if not k]
    assert [(e["kept"], e["started"]) for e in restart] == [([lr for lr, k in enumerate(kept) if k], new)]
    assert restart[0]["seconds"] < 20.0  # the 2 s deadline and a new process, not --shutdown-timeout's 30 s
    assert _digest(out) == reference


def test_a_survivor_waiting_in_a_system_call_is_woken_and_kept(reference, tmp_path):
    """Rank 1 is SIGKILLed while rank 2 sleeps an hour in ``time.sleep``: the abort's signal ends the
    sleep, so rank 2 is ready at once and keeps its process, like rank 0 (before the wake signal it
    slept past the ready deadline and was killed and replaced, as a blocked call still is)."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, "--inprocess-timeout=5", SCRIPT, str(out), "--kill", "1:5", "--sleep", "2:5",
            "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not ready within" not in r.stderr
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, True]
    assert _digest(out) == reference


def test_the_wake_signal_leaves_a_scripts_own_sigurg_handler_alone(reference, tmp_path):
    """A script that handles SIGURG itself: an abort does not signal it (its handler never runs), so
    rank 2, asleep when rank 1 is SIGKILLed, is not woken: it is killed after --inprocess-timeout and
    replaced, as before the wake signal; rank 0 keeps its process."""
    out, seen = tmp_path / "out", tmp_path / "sigurg.txt"
    out.mkdir()
    r = run("elaunch", *JOB, "--inprocess-timeout=2", SCRIPT, str(out), "--kill", "1:5", "--sleep", "2:5",
            "--own-sigurg", str(seen), "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not seen.exists(), seen.read_text()
    assert "local rank(s) [2] not ready within 2.0 s; killing them" in r.stderr
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, False]
    assert _digest(out) == reference


def test_a_survivor_runs_its_next_round_under_a_profiler(reference, tmp_path):
    """Rank 1 is SIGKILLed; the survivors run main() again under a profile function (``sys.setprofile``,
    as cProfile, a debugger or coverage). The abort left nothing pending in their interpreter: the
    job ends with the uninterrupted run's parameters. (Before, the wrapper cleared a possibly pending
    abort with ``PyThreadState_SetAsyncExc(tid, NULL)``, which on CPython 3.11 leaves the eval loop's
    async-exception flag set with no exception: under a profiler, the survivor then spun at the
    first line of main() for ever.)"""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, SCRIPT, str(out), "--kill", "1:5", "--profile", "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, True]
    assert _digest(out) == reference


def test_a_raise_with_no_restart_left_fails_the_job_as_before(tmp_path):
    """--max-restarts=0: the raising rank is the root cause (exit code 1, its traceback), every worker is
    stopped, the job fails with exit status 1 and nothing is left behind."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", "--standalone", "--nproc-per-node=3", "--max-restarts=0", SCRIPT, str(out), "--raise", "1:5",
            "--timeout", PG_TIMEOUT, timeout=40)
    assert r.returncode == 1, r.stderr[-3000:]
    root = r.stderr[r.stderr.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1" in root, root
    assert "planted fault on rank 1" in root  # the stderr tail of the summary
    assert not (out / "final.json").exists()


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
def test_a_hang_kills_only_its_culprit(reference, tmp_path):
    """--hang-timeout: rank 1 stops itself (SIGSTOP); the verdict kills only it, the ranks waiting behind it
    are interrupted and keep their processes."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, "--hang-timeout=2", SCRIPT, str(out), "--stop", "1:5", "--timeout", PG_TIMEOUT,
            timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HUNG: rank 1 (local rank 1)" in r.stderr
    rounds = _rounds(out)
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, True]
    assert _digest(out) == reference


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
def test_undecorated_script_restarts_every_worker(reference, tmp_path):
    """Without the decorator nothing changes: a SIGKILL restarts all three workers in new processes."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", *JOB, SCRIPT, str(out), "--plain", "--kill", "1:5", "--timeout", PG_TIMEOUT, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    rounds = _rounds(out)
    assert not {a["pid"] for a in rounds[0]} & {a["pid"] for a in rounds[1]}
    assert "in-process restart" not in r.stderr
    assert _digest(out) == reference


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
def test_two_nodes_a_sigkill_on_one_keeps_every_other_process(tmp_path):
    """Two agents (c10d, loopback), 2 workers each: rank 1 (node 0) is SIGKILLed. Node 0 replaces it and keeps
    rank 0; node 1's workers, whose collectives broke, restart in process too. One restart for the job."""
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start_agent("c10d", endpoint, SCRIPT, str(out), "--kill", "1:5", "--timeout", PG_TIMEOUT,
                          rdzv_id="inproc", nproc_per_node=2, extra=("--max-restarts=1",)) for _ in range(2)]
    results = finish_agents(agents, timeout=60)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, err, _ in results]
    rounds = _rounds(out)
    assert [a["world"] for a in rounds[1]] == [4, 4, 4, 4]
    assert [a["pid"] == b["pid"] for a, b in zip(rounds[0], rounds[1])] == [True, False, True, True]
    assert {a["start"] for a in rounds[1]} == {rounds[1][0]["start"]}  # one agreed step
    assert all("restart 1/1" in err for _, err, _ in results)


def _calls(out: Path) -> list[dict]:
    """Every call of main() recorded so far (its first step done), in the order they started."""
    recs = []
    for path in out.glob("round_*.json"):
        try:
            recs.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # written with a rename: only a vanished file
            continue
    return sorted(recs, key=lambda r: r["started"])


class _Nodes:
    """Agents of one c10d job on loopback, one worker each (``restartable_train.py`` until ``stop`` is touched),
    each with its stderr in ``<name>.err`` and its log directory ``logs/<name>``; the first one started hosts
    the rendezvous store (the next start waits for it), so the death of any other leaves the job its store."""

    def __init__(self, tmp_path: Path, nnodes: str, conf: str) -> None:
        self.tmp, self.out, self.logs, self.stop = tmp_path, tmp_path / "out", tmp_path / "logs", tmp_path / "stop"
        self.out.mkdir()
        self.port = free_port()
        self.nnodes, self.conf = nnodes, conf
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        from tests.conftest import wait_for
        from tests.helpers import start

        with open(self.tmp / f"{name}.err", "w") as err:
            self.agents[name] = start(
                "elaunch", f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=nodes", f"--rdzv-conf={self.conf}",
                "--local-addr=127.0.0.1", "--monitor-interval=0.1", "--max-restarts=3", "--log-dir",
                str(self.logs / name), SCRIPT, str(self.out), "--steps", "100000", "--step-sleep", "0.05",
                "--stop-file", str(self.stop), "--timeout", PG_TIMEOUT, stderr=err, stdout=subprocess.DEVNULL)
        if len(self.agents) == 1:
            host = psutil.Process(self.agents[name].pid)
            wait_for(lambda: any(c.laddr.port == self.port and c.status == psutil.CONN_LISTEN
                                 for c in host.net_connections()), 60, what=f"node {name}'s store")
        return self.agents[name]

    def err(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def kill(self, name: str) -> None:
        """The node is gone: its agent and its worker, no goodbye."""
        from tests.helpers import kill_tree

        kill_tree(self.agents[name].pid)
        self.agents[name].wait(10)

    def close(self) -> None:
        from tests.helpers import kill_tree

        for proc in self.agents.values():
            kill_tree(proc.pid)


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
def test_scale_up_and_node_lost_keep_the_survivors_processes(tmp_path):
    """--nnodes=2:3, one worker a node. Nodes A and B train (world 2); node C joins: a scale-up, whichever of A and
    B sees C first interrupts its worker, the other's worker sees its collective break ("raised" while a node
    waits: the scale-up's doing, not a failure), and both are re-formed in process with C's new worker (world 3).
    Then C is SIGKILLed whole (agent and worker: a node lost) and A's and B's workers go on (world 2) in the same
    processes, to the end. No restart is counted."""
    from tests.conftest import wait_for

    nodes = _Nodes(tmp_path, "2:3", "last_call_timeout=1,join_timeout=60")
    out, logs = nodes.out, nodes.logs
    try:
        nodes.start("a")
        nodes.start("b")
        first = wait_for(lambda: [c for c in _calls(out) if c["world"] == 2] if len(_calls(out)) == 2 else None, 60,
                         what="A's and B's workers trained a step")
        pids = {c["pid"] for c in first}
        nodes.start("c")
        wait_for(lambda: [c for c in _calls(out) if c["world"] == 3 and c["pid"] not in pids], 60,
                 what="node C's worker trained a step in a world of 3")
        nodes.kill("c")
        try:
            wait_for(lambda: len([c for c in _calls(out) if c["pid"] in pids and c["call"] == 3]) == 2, 90,
                     what="A's and B's workers called a third time")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- a:\n{nodes.err('a')[-6000:]}\n--- b:\n{nodes.err('b')[-6000:]}") from None
        nodes.stop.touch()  # enough: the job ends at the next step
        for name in ("a", "b"):
            assert nodes.agents[name].wait(90) == 0, nodes.err(name)[-3000:]
    finally:
        nodes.close()
    for pid in pids:  # one process each, three worlds
        assert [(c["call"], c["world"]) for c in _calls(out) if c["pid"] == pid] == [(1, 2), (2, 3), (3, 2)]
    for world, call in ((3, 2), (2, 3)):
        ranks = [c for c in _calls(out) if c["world"] == world and (c["call"] == call or c["pid"] not in pids)]
        assert sorted(c["rank"] for c in ranks) == list(range(world))
        assert len({c["start"] for c in ranks}) == 1 and ranks[0]["start"] > 0  # all resumed at the agreed step
    for name in ("a", "b"):
        events = _events(logs / name)
        assert [(e["cause"], e["world_size"], len(e["kept"])) for e in events if e["kind"] == "inprocess_restart"] \
            == [("membership", 3, 1), ("membership", 2, 1)]
        assert not [e for e in events if e["kind"] == "restart" and e["counted"]]  # nothing counted
        # a kept worker whose collective broke is described as raised, never by an exit code it did not have
        assert "exitcode 1) after node(s)" not in nodes.err(name)
    assert (out / "final.json").exists()


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite is near its 20 minutes
def test_a_signal_while_survivors_wait_for_the_next_round_is_forwarded_to_them(tmp_path):
    """--nnodes=2: node B is SIGKILLed whole, so node A's worker is kept and A waits in the rendezvous for a
    second node. A SIGTERM to A's agent then reaches the kept worker as a SIGTERM (torchrun forwards its
    signal to every worker), not as the SIGKILL a job's end gives a kept worker."""
    from tests.conftest import wait_for

    nodes = _Nodes(tmp_path, "2", "join_timeout=60")
    try:
        a = nodes.start("a")
        nodes.start("b")
        calls = wait_for(lambda: [c for c in _calls(nodes.out) if c["world"] == 2]
                         if len(_calls(nodes.out)) == 2 else None, 60, what="both workers trained a step")
        (kept,) = [psutil.Process(c["pid"]) for c in calls
                   if c["pid"] in [p.pid for p in psutil.Process(a.pid).children(recursive=True)]]
        nodes.kill("b")
        wait_for(lambda: sum(e["kind"] == "rendezvous_join" for e in _events(nodes.logs / "a")) == 2, 60,
                 what="node A joining the next round, its worker kept")
        assert kept.is_running()
        a.send_signal(signal.SIGTERM)
        a.wait(60)
    finally:
        nodes.close()
    err = nodes.err("a")
    assert f"local rank 0's kept worker {kept.pid}, waiting for the next round, ended (signal SIGTERM)" in err, \
        err[-3000:]


@pytest.mark.parametrize("leave_thread", [False, True])
def test_a_round_aborted_inside_init_process_group_lets_the_next_one_form(tmp_path, leave_thread):
    """A survivor interrupted inside ``init_process_group`` had counted the group that never formed
    (torch's ``_world.group_count``), so its next round's default group got another name than the
    replacement's: both waited on different store keys until gloo's timeout (found by an audit). The
    wrapper now resets the count when no group is left; the next round forms at once. A non-daemon thread
    the aborted round left behind is named in one warning line (such threads kept a process from exiting)."""
    from tests.conftest import wait_for
    from tests.helpers import kill_tree

    out = tmp_path / "out"
    out.mkdir()
    agent = start("elaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                  str(SCRIPTS / "restartable_init_abort.py"), str(out), *(["--leave-thread"] if leave_thread else []))
    try:
        wait_for(lambda: (out / "entering_init").exists() and (out / "pid_1_0").exists(), 60,
                 what="rank 0 entering init_process_group while rank 1 waits")
        os.kill(int((out / "pid_1_0").read_text()), signal.SIGKILL)
        _, err = agent.communicate(timeout=90)  # a deadline: the group's own timeout is 20 s
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 0, err[-3000:]
    done = {rank: (out / f"done_{rank}_1").read_text().split() for rank in (0, 1)}
    assert [d[0] for d in done.values()] == ["2.0", "2.0"]
    assert done[0][1] == (out / "pid_0_0").read_text()  # rank 0 kept its process: an in-process restart
    warned = [line for line in err.splitlines() if "non-daemon thread(s) main() started" in line]
    assert len(warned) == leave_thread and all("(left-by-round-0)" in line for line in warned), err[-3000:]
