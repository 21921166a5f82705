"""The agent's side of in-memory checkpoints, with real agents (``python -m elaunch``), workers and /dev/shm.

The workers (tests/scripts/ckpt_worker.py) save with ``elaunch.checkpoint.save`` and
report what ``ckpt.load()`` gave them; these tests check what the agent made of it:
the restored step after a worker was killed, the node directory's mode and its removal
(after the run, and after ``kill -9`` of the agent), the worker environment, the
restore event, and the options' bad values.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import SCRIPTS, alive, kill_tree, launcher_env, run, start

pytest.importorskip("torch")

WORKER = str(SCRIPTS / "ckpt_worker.py")


def reports(out: Path) -> dict[str, dict]:
    """``<rank>_<restarts>`` -> the worker's report."""
    return {p.name[:-5]: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def events(log_dir: Path, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
    return found


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_worker_killed_after_saving_step_k_is_restarted_at_step_k(tmp_path, sharded):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    args = [WORKER, str(out), "3", "--die-rank", "1", "--die-after", "2"] + (["--sharded"] if sharded else [])
    r = run("elaunch", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={logs}", *args, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = reports(out)
    assert sorted(got) == ["0_0", "0_1", "1_0", "1_1"], got
    for rank in (0, 1):
        first, again = got[f"{rank}_0"], got[f"{rank}_1"]
        assert first["step"] is None and "ELAUNCH_CHECKPOINT_RESTORE" not in first["env"]
        assert again["restarts"] == 1  # the restart was counted
        assert again["step"] == 2 and again["state_ok"] is True, again
        env = again["env"]
        assert env["ELAUNCH_CHECKPOINT_STEP"] == "2"
        assert env["ELAUNCH_CHECKPOINT_RESTORE"].startswith(env["ELAUNCH_CHECKPOINT_SHM"] + "/slots/")
        if sharded:  # each rank its own slot
            assert os.path.basename(env["ELAUNCH_CHECKPOINT_RESTORE"]).startswith(f"{rank}.")
        assert first["shm_mode"] == again["shm_mode"] == 0o700
        assert os.path.basename(env["ELAUNCH_CHECKPOINT_SHM"]).startswith("elaunch-")
    (restore,) = events(logs, "checkpoint_restore")
    assert restore["step"] == 2 and restore["round"] == 1 and restore["sources"] == {"0": "memory", "1": "memory"}
    shm = got["0_1"]["env"]["ELAUNCH_CHECKPOINT_SHM"]
    assert not os.path.exists(shm), "the node directory outlived the run"


def test_the_node_directory_goes_with_an_agent_killed_by_sigkill(tmp_path):
    """And so does the directory of the workers' progress and stacks files."""
    out = tmp_path / "out"
    out.mkdir()
    agent = start("elaunch", "--nproc-per-node=1", WORKER, str(out), "2", "--wait-for", str(tmp_path / "never"),
                  env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        report = wait_for(lambda: (out / "0_0.json").exists() and json.loads((out / "0_0.json").read_text()),
                          60, what="the worker's report")
        shm = report["env"]["ELAUNCH_CHECKPOINT_SHM"]
        wait_for(lambda: len(os.listdir(os.path.join(shm, "slots"))) >= 2, 60, what="the worker's saves")
        with open(f"/proc/{report['pid']}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        progress = os.path.dirname(os.fsdecode(env[b"ELAUNCH_PROGRESS_FILE"]))
        assert os.path.isdir(progress) and os.path.basename(progress).startswith("elaunch-progress-")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: not os.path.exists(shm), 10, what=f"the reaper to remove {shm}")
        wait_for(lambda: not os.path.exists(progress), 10, what=f"the reaper to remove {progress}")
        wait_for(lambda: not alive(report["pid"]), 10, what="the worker to die")
    finally:
        kill_tree(agent.pid)


@pytest.mark.parametrize("flag, message", [
    ("--checkpoint-replicas=two", "--checkpoint-replicas=two: expected auto or an integer >= 0"),
    ("--checkpoint-replicas=-1", "--checkpoint-replicas=-1: expected auto or an integer >= 0"),
    ("--checkpoint-persist-interval=-5", "--checkpoint-persist-interval=-5: must be >= 0 seconds"),
    ("--checkpoint-timeout=0", "--checkpoint-timeout=0: must be > 0 seconds"),
    ("--checkpoint-exchange-timeout=x", "--checkpoint-exchange-timeout=x: expected seconds (a number)"),
    ("--checkpoint-dir=" + str(SCRIPTS / "say.py"), "not a directory"),
])
def test_bad_checkpoint_options_are_one_line_and_exit_2(flag, message):
    r = run("elaunch", flag, str(SCRIPTS / "say.py"), timeout=60)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def persisted_file(ckpt_dir: Path, step: int, rank: int = 0, world: int = 1) -> Path:
    return ckpt_dir / f"step_{step:012d}" / f"rank_{rank}_of_{world}.pt"


def test_sigterm_persists_the_newest_snapshot_before_the_agent_exits(tmp_path):
    import torch

    out, logs, ckpt_dir = tmp_path / "out", tmp_path / "logs", tmp_path / "ckpt"
    out.mkdir()
    agent = start("elaunch", "--nproc-per-node=1", f"--log-dir={logs}", f"--checkpoint-dir={ckpt_dir}",
                  "--checkpoint-persist-interval=0", WORKER, str(out), "3", "--wait-for", str(tmp_path / "never"),
                  env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (out / "saved_0_2").exists(), 60, what="the worker's save of step 2")
        assert not persisted_file(ckpt_dir, 2).exists()  # interval 0: nothing persisted in the background
        agent.send_signal(signal.SIGTERM)
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = torch.load(persisted_file(ckpt_dir, 2), weights_only=False)  # torch alone reads it
    assert saved["step"] == 2 and saved["rank"] == 0 and bool((saved["state"]["w"] == 2.0).all())
    (persisted,) = events(logs, "checkpoint_persisted")
    assert persisted["step"] == 2 and persisted["seconds"] >= 0
    shm = json.loads((out / "0_0.json").read_text())["env"]["ELAUNCH_CHECKPOINT_SHM"]
    assert not os.path.exists(shm)


def test_a_dead_worker_has_its_snapshot_persisted_and_the_restart_restores_it(tmp_path):
    out, logs, ckpt_dir = tmp_path / "out", tmp_path / "logs", tmp_path / "ckpt"
    out.mkdir()
    r = run("elaunch", "--nproc-per-node=1", "--max-restarts=1", f"--log-dir={logs}", f"--checkpoint-dir={ckpt_dir}",
            "--checkpoint-persist-interval=0", WORKER, str(out), "3", "--die-rank", "0", "--die-after", "1",
            "--wait-for", str(persisted_file(ckpt_dir, 1)), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert reports(out)["0_1"]["step"] == 1  # from memory, not from the disk
    assert [e["step"] for e in events(logs, "checkpoint_persisted")][:1] == [1]
    (restore,) = events(logs, "checkpoint_restore")
    assert restore["sources"] == {"0": "memory"}


def _listens_on(pid: int, port: int) -> bool:
    import psutil

    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


@pytest.mark.parametrize("state", ["sharded", "replicated"])
@pytest.mark.parametrize("endpoint", ["c10d"], indirect=True)
def test_a_node_that_replaces_a_lost_one_restores_from_a_peers_memory(endpoint, state, tmp_path):
    """Two agents save step 2; of sharded state each keeps the other's copy (a replica). One is killed (kill -9)
    and a fresh node takes its place: its rank restores step 2 fetched from the survivor's memory (the replica;
    of replicated state, the survivor's own snapshot: no replica was sent, the survivor had saved that step),
    the survivor's rank from its own."""
    _backend, ep = endpoint
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    agents: dict[str, object] = {}
    errs = {name: tmp_path / f"{name}.err" for name in "ABC"}

    def agent(name: str):
        with open(errs[name], "w") as err:
            agents[name] = start("elaunch", "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                                 f"--rdzv-endpoint={ep}", "--rdzv-id=ckpt-peer",
                                 "--rdzv-conf=last_call_timeout=1,join_timeout=60", "--local-addr=127.0.0.1",
                                 f"--log-dir={tmp_path / name}", WORKER, str(out), "3", "--wait-for", str(stop),
                                 *(["--sharded"] if state == "sharded" else []),
                                 env=launcher_env(), stdout=subprocess.DEVNULL, stderr=err)

    def stderr() -> str:
        return "".join(f"--- {n} ---\n{p.read_text(errors='replace')[-2500:]}\n" for n, p in errs.items()
                       if p.exists())

    try:
        agent("A")
        agent("B")
        wait_for(lambda: all((out / f"saved_{r}_2").exists() for r in (0, 1)), 120, what="both ranks' step 2")
        first = reports(out)
        shms = {r: first[f"{r}_0"]["env"]["ELAUNCH_CHECKPOINT_SHM"] for r in (0, 1)}
        replicas = (f"{shms[0]}/replicas/r1", f"{shms[1]}/replicas/r0")
        if state == "sharded":  # each node keeps the other's snapshot: the ring of two
            wait_for(lambda: all(os.path.exists(p) for p in replicas), 60, what="the replicas")
        port = int(ep.rpartition(":")[2])
        victim = next(n for n in ("B", "A") if not _listens_on(agents[n].pid, port))  # the store stays up
        survivor = "A" if victim == "B" else "B"
        os.kill(agents[victim].pid, signal.SIGKILL)
        agents[victim].wait(10)
        agent("C")
        wait_for(lambda: sum(1 for rep in reports(out).values() if rep["step"] == 2) == 2, 120,
                 what=f"both ranks restored\n{stderr()}")
        stop.touch()
        for name in (survivor, "C"):
            assert agents[name].wait(90) == 0, stderr()
    finally:
        for a in agents.values():
            kill_tree(a.pid)
    restored = [rep for rep in reports(out).values() if rep["step"] == 2]
    assert sorted(rep["rank"] for rep in restored) == [0, 1] and all(rep["state_ok"] for rep in restored)
    assert all(rep["restarts"] == 0 for rep in restored)  # a node replaced: not a counted restart
    (fresh,) = events(tmp_path / "C", "checkpoint_restore")
    (kept,) = events(tmp_path / survivor, "checkpoint_restore")
    assert fresh["step"] == kept["step"] == 2
    assert list(fresh["sources"].values()) == ["peer"] and list(kept["sources"].values()) == ["memory"]
    wait_for(lambda: not os.path.exists(shms[0]) and not os.path.exists(shms[1]), 10, what="the node dirs to go")


@pytest.mark.parametrize("end", ["close", "eof"])
def test_the_reaper_removes_a_registered_node_directory_and_nothing_else(tmp_path, end):
    """At the run's end (``close``: the agent's handle removes them before the watchdog's end of file) and when
    the agent dies (``eof``: only the pipe's end reaches the watchdog, which removes them itself)."""
    from elaunch.procs.reaper import start_reaper

    node_dir = f"/dev/shm/elaunch-reaper-test-{os.getpid()}"
    os.makedirs(os.path.join(node_dir, "slots"), mode=0o700)
    (Path(node_dir) / "slots" / "0.0").write_bytes(b"x")
    outside = tmp_path / "elaunch-not-shm"
    outside.mkdir()
    reaper = start_reaper()
    try:
        reaper.remove_on_exit(node_dir)
        reaper.remove_on_exit(str(outside))  # not under /dev/shm: ignored
        assert reaper.sync()
        assert os.path.exists(node_dir)  # only when the agent goes
        if end == "eof":
            reaper._close_fd()  # what the kernel does when the agent dies
            wait_for(lambda: not reaper.alive(), 10, what="the watchdog to exit")
    finally:
        reaper.close()
        if os.path.exists(node_dir):
            import shutil

            shutil.rmtree(node_dir)
            raise AssertionError("the reaper left the node directory")
    assert outside.exists()


def test_a_warm_spare_runs_the_restored_worker(tmp_path):
    """The restore's variables are the round's: a spare started before them still takes the worker."""
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", "--nproc-per-node=2", "--max-restarts=1", "--warm-start", "--warm-start-modules=torch",
            WORKER, str(out), "3", "--die-rank", "1", "--die-after", "2", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = reports(out)
    for rank in (0, 1):
        assert got[f"{rank}_1"]["step"] == 2 and got[f"{rank}_1"]["warm"] is True, got[f"{rank}_1"]
    assert got["0_0"]["warm"] is True  # the first attempt's spare, started before the round formed


def _mapped_slots(pid: int) -> set[str]:
    """The snapshot slot files (``.../slots/<local rank>.<0|1>``) mapped in process ``pid``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split()[-1] for line in f if "/slots/" in line}
    except OSError:
        return set()


def _slot_rss(pid: int) -> tuple[int, int]:
    """(Rss, Size) in bytes of the slot-file mappings of process ``pid``: the pages it faulted in, of how many."""
    rss = size = 0
    current = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range ... path
                current = "/slots/" in line
            elif current and head[0] in ("Rss:", "Size:"):
                kib = int(head[1]) * 1024
                rss, size = (rss + kib, size) if head[0] == "Rss:" else (rss, size + kib)
    return rss, size


def test_a_warm_spare_maps_the_slots_before_its_worker_saves(tmp_path):
    """A restarted worker's first two saves faulted every page of both slot files into its new
    mapping (0.3 s each for 256 MiB, against 0.05 s later on): the next attempt's spare of each local
    rank, forked from the node's warm template, maps that rank's slots while it waits (the template
    imports with what the ranks share; each spare is given its own ``LOCAL_RANK`` as it is forked)."""
    import psutil

    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    agent = start("elaunch", "--nproc-per-node=2", "--max-restarts=1", "--warm-start", "--warm-start-modules=torch",
                  WORKER, str(out), "2", "--wait-for", str(stop), env=launcher_env())
    try:
        wait_for(lambda: all((out / f"saved_{r}_1").exists() for r in (0, 1)), 120, what="both slots saved into")
        workers = {json.loads((out / f"{r}_0.json").read_text())["pid"] for r in (0, 1)}  # forks of it too

        def spares_with_slots():
            found = {}
            for child in psutil.Process(agent.pid).children():
                try:
                    forked = "--template" in child.cmdline()
                except psutil.Error:
                    continue
                mapped = _mapped_slots(child.pid) if forked and child.pid not in workers else []
                if len(mapped) == 2:
                    found[child.pid] = {os.path.basename(p) for p in mapped}
            return found if len(found) == 2 else None

        spares = wait_for(spares_with_slots, 120, what="each rank's spare with both its slot files mapped")
        assert sorted(map(sorted, spares.values())) == [["0.0", "0.1"], ["1.0", "1.1"]], spares
        # and faulted in: every page of both mappings resident in the spare (it maps them, then populates)
        for pid in spares:
            wait_for(lambda: (lambda r: r[1] and r[0] == r[1])(_slot_rss(pid)), 60,
                     what="both slot mappings faulted in")
        stop.touch()
        assert agent.wait(60) == 0
    finally:
        kill_tree(agent.pid)
        agent.communicate()


CHECKPOINT_MODULES = ("elaunch.checkpoint._read", "elaunch.checkpoint._tree", "elaunch.checkpoint.dcp")


def test_a_warm_spare_has_imported_what_a_restore_needs(tmp_path):
    """A replacement's ``from elaunch.checkpoint import SnapshotReader`` took 50-90 ms of its start on loaded
    namespace hosts: every spare, the first attempt's and those forked for the next, has the checkpoint
    modules a save or restore uses imported before the script runs (``dcp`` once the job's warm modules
    include ``torch.distributed.checkpoint``)."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        f"seen = {{m: m in sys.modules for m in {CHECKPOINT_MODULES!r}}}\n"
        "seen['forked'] = '--template' in open('/proc/self/cmdline').read().split(chr(0))\n"
        "rank, attempt = os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "open(os.path.join(sys.argv[1], f'{rank}_{attempt}.json'), 'w').write(json.dumps(seen))\n"
        "sys.exit(1 if (rank, attempt) == ('1', '0') else 0)\n")
    out = tmp_path / "out"
    out.mkdir()
    r = run("elaunch", "--nproc-per-node=2", "--max-restarts=1", "--warm-start",
            "--warm-start-modules=torch,torch.distributed.checkpoint", str(script), str(out), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("0_0", "1_0", "0_1", "1_1"):
        # every spare forked from the node's template (what the template imports starts no thread)
        assert json.loads((out / f"{name}.json").read_text()) == {**dict.fromkeys(CHECKPOINT_MODULES, True),
                                                                 "forked": True}, name


def test_a_forwarded_notice_persists_at_once(tmp_path):
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    agent = start("elaunch", "--nproc-per-node=1", f"--checkpoint-dir={ckpt_dir}", "--checkpoint-persist-interval=0",
                  WORKER, str(out), "2", "--wait-for", str(tmp_path / "stop"), env=launcher_env(),
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (out / "saved_0_1").exists(), 60, what="the worker's save of step 1")
        agent.send_signal(signal.SIGUSR1)  # Slurm's preemption notice: forwarded, and a persist
        wait_for(lambda: persisted_file(ckpt_dir, 1).exists(), 30, what="the persist of step 1")
        (tmp_path / "stop").touch()
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 0, err[-3000:]


@pytest.mark.parametrize("endpoint", ["c10d"], indirect=True)
def test_status_shows_the_nodes_newest_step_and_memory(endpoint, tmp_path):
    import subprocess as sp
    import sys

    _backend, ep = endpoint
    out = tmp_path / "out"
    out.mkdir()
    agent = start("elaunch", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={ep}",
                  "--rdzv-id=ckpt-status", "--local-addr=127.0.0.1", WORKER, str(out), "3", "--wait-for",
                  str(tmp_path / "stop"), env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def status() -> dict | None:
        r = sp.run([sys.executable, "-m", "elaunch.status", "--rdzv-backend=c10d", f"--rdzv-endpoint={ep}",
                    "--rdzv-id=ckpt-status", "--json"], capture_output=True, text=True, timeout=60)
        node = json.loads(r.stdout)["nodes"][0] if r.returncode == 0 else None
        return node if node and node.get("checkpoint") and node["checkpoint"]["step"] == 2 else None

    try:
        wait_for(lambda: (out / "saved_0_2").exists(), 60, what="the worker's save of step 2")
        node = wait_for(status, 60, interval=1.0, what="a status with step 2")
        assert node["checkpoint"]["bytes"] > 0 and 0 <= node["checkpoint"]["age"] < 60
        (tmp_path / "stop").touch()
        _out, err = agent.communicate(timeout=60)
    finally:
        kill_tree(agent.pid)
    assert agent.returncode == 0, err[-3000:]
