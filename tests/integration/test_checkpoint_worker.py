"""The worker side of in-memory checkpoints (issue 24, items 1, 2, 5): real worker processes, real /dev/shm files.

Workers are ``tests/scripts/ckpt_roundtrip.py`` run with the environment an elaunch agent
gives them (``ELAUNCH_CHECKPOINT_SHM``, ``ELAUNCH_CHECKPOINT_RESTORE``,
``ELAUNCH_CHECKPOINT_STEP``, ranks) or, for the fallback mode, without it.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import elaunch.checkpoint as ckpt  # noqa: E402
from elaunch.checkpoint import _shm, persisted, slotfile  # noqa: E402
from tests.conftest import NOT_APPLICABLE, SCRIPTS, wait_for  # noqa: E402
from tests.helpers import free_port  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
from ckpt_roundtrip import make_state, same  # noqa: E402

WORKER = str(SCRIPTS / "ckpt_roundtrip.py")
_ENV_DROP = ("ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP",
             "ELAUNCH_CHECKPOINT_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def worker_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP and not k.startswith("CKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS.parents[1]), env.get("PYTHONPATH", "")])
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_worker(*args, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKER, *map(str, args)], env=worker_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def load_result(**env) -> dict:
    r = run_worker("load", **env)
    assert r.returncode in (0, 3), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def shm_dir():
    """A node directory in /dev/shm, removed after the test (with this process's cached mappings)."""
    path = f"/dev/shm/elaunch-test-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    yield path
    _shm.close_all()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_shm():
    """A node directory on its own 8 MiB tmpfs (mounted here; root only), unmounted after."""
    path = f"/dev/shm/elaunch-test-{os.getpid()}-small"
    os.makedirs(path, mode=0o700, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a small tmpfs (needs root): {r.stderr.strip()}")
    yield path
    _shm.close_all()
    subprocess.run(["umount", path], check=True)
    os.rmdir(path)


def committed(shm: str) -> dict[str, int]:
    """Slot file name -> the step it holds committed."""
    return {os.path.basename(i.path): i.step for i in slotfile.inventory(shm)}


def test_round_trip_is_bit_identical(shm_dir):
    r = run_worker("save", 3, 4, ELAUNCH_CHECKPOINT_SHM=shm_dir, LOCAL_RANK=0, RANK=0, WORLD_SIZE=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert committed(shm_dir) == {"0.0": 3, "0.1": 4}
    for name in ("slots", "slots/0.0", "slots/0.1"):
        mode = os.stat(os.path.join(shm_dir, name)).st_mode & 0o777
        assert mode == (0o700 if name == "slots" else 0o600), (name, oct(mode))
    snap = ckpt.read_slot(os.path.join(shm_dir, "slots", "0.1"))
    assert snap.step == 4 and same(snap.state, make_state(4))
    assert snap.state["model"]["shared"] is snap.state["model"]["same"]
    # a fresh worker restores the step the job agreed on
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=f"{shm_dir}/slots/0.0",
                      ELAUNCH_CHECKPOINT_STEP=3)
    assert got == {"step": 3, "equal": True}
    assert load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir) == {"step": None}


def test_saves_go_into_the_slots_the_agent_reserved_without_growing_them(shm_dir):
    """A replacement node's agent reserves its rank's slots at the restored snapshot's size (``slotfile.reserve``):
    the worker's saves commit into those very files, as they are, and read back whole."""
    peer = shm_dir + "/peer"
    os.mkdir(peer, 0o700)
    assert run_worker("save", 3, ELAUNCH_CHECKPOINT_SHM=peer).returncode == 0
    size = slotfile.read_info(os.path.join(peer, "slots", "0.0")).size
    os.mkdir(os.path.join(shm_dir, "slots"), 0o700)
    assert slotfile.reserve(shm_dir, 0, size) == 2 * (-(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    reserved = {p: (os.stat(p).st_ino, os.stat(p).st_size) for p in slotfile.slot_paths(shm_dir, 0)}
    r = run_worker("save", 4, 5, ELAUNCH_CHECKPOINT_SHM=shm_dir, LOCAL_RANK=0, RANK=0, WORLD_SIZE=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p: (os.stat(p).st_ino, os.stat(p).st_size) for p in reserved} == reserved
    assert committed(shm_dir) == {"0.0": 4, "0.1": 5}
    assert same(ckpt.read_slot(os.path.join(shm_dir, "slots", "0.1")).state, make_state(5))


def test_header_names_rank_and_world(shm_dir):
    r = run_worker("save", 7, ELAUNCH_CHECKPOINT_SHM=shm_dir, LOCAL_RANK=1, RANK=5, WORLD_SIZE=6, CKPT_SHARDED=1)
    assert r.returncode == 0, r.stderr[-3000:]
    info = slotfile.read_info(os.path.join(shm_dir, "slots", "1.0"))
    assert (info.step, info.rank, info.world_size, info.replicated) == (7, 5, 6, False)
    assert same(ckpt.read_slot(info.path).state, make_state(7, 5))


def test_restored_step_must_be_the_agreed_one(shm_dir):
    assert run_worker("save", 5, ELAUNCH_CHECKPOINT_SHM=shm_dir).returncode == 0
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=f"{shm_dir}/slots/0.0",
                      ELAUNCH_CHECKPOINT_STEP=6)
    assert "holds step 5" in got["error"] and "step 6" in got["error"]
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=f"{shm_dir}/slots/0.1",
                      ELAUNCH_CHECKPOINT_STEP=5)
    assert "cannot open" in got["error"]


def test_kill_during_a_save_leaves_the_previous_snapshot_whole(shm_dir):
    """SIGKILL while a slot's seq is odd (a copy under way): the other slot still holds its step, intact."""
    proc = subprocess.Popen([sys.executable, WORKER, "loop", "1"], stdout=subprocess.PIPE, text=True,
                            env=worker_env(ELAUNCH_CHECKPOINT_SHM=shm_dir, CKPT_MIB=96))
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        maps = {}

        def writing():
            for name in ("0.0", "0.1"):
                if name not in maps:
                    try:
                        with open(os.path.join(shm_dir, "slots", name), "rb") as f:
                            maps[name] = mmap.mmap(f.fileno(), slotfile.HEADER_SIZE, prot=mmap.PROT_READ)
                    except (OSError, ValueError):
                        continue  # not made or not sized yet
                if slotfile.seq_of(maps[name]) % 2:
                    return name
            return None

        torn = wait_for(writing, timeout=60, interval=0, what="a save under way (odd seq)")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        for m in maps.values():
            m.close()
    finally:
        proc.kill()
        proc.wait()
    other = "0.1" if torn == "0.0" else "0.0"
    assert slotfile.read_info(os.path.join(shm_dir, "slots", torn)) is None
    info = slotfile.read_info(os.path.join(shm_dir, "slots", other))
    assert info is not None
    snap = ckpt.read_slot(info.path)
    assert same(snap.state, make_state(info.step, mib=96))
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=info.path,
                      ELAUNCH_CHECKPOINT_STEP=info.step, CKPT_MIB=96)
    assert got == {"step": info.step, "equal": True}
    assert run_worker("save", info.step + 1, ELAUNCH_CHECKPOINT_SHM=shm_dir).returncode == 0
    assert committed(shm_dir) == {other: info.step, torn: info.step + 1}  # the torn slot is written next


def test_a_slot_overwritten_while_read_raises_never_mixes_steps(shm_dir):
    """A reader racing a worker that saves without pause: each read is one whole step, or CheckpointError.

    The worker cycles through 3 states made once, so it spends its time copying, and slot
    0.0 (every other step) gets a different state each time. Each read of 0.0 starts as
    the worker commits 0.1, that is as it turns to overwrite 0.0.
    """
    proc = subprocess.Popen([sys.executable, WORKER, "loop", "1"], stdout=subprocess.DEVNULL, text=True,
                            env=worker_env(ELAUNCH_CHECKPOINT_SHM=shm_dir, CKPT_MIB=32, CKPT_CYCLE=3))
    seen = {"whole": 0, "changed": 0, "empty": 0}
    other = os.path.join(shm_dir, "slots", "0.1")
    try:
        wait_for(lambda: slotfile.read_info(other), timeout=60, what="the worker's second save")
        with open(other, "rb") as f:
            header = mmap.mmap(f.fileno(), slotfile.HEADER_SIZE, prot=mmap.PROT_READ)

        def raced():
            wait_for(lambda: slotfile.seq_of(header) % 2, timeout=30, interval=0, what="a write of slot 0.1")
            wait_for(lambda: slotfile.seq_of(header) % 2 == 0, timeout=30, interval=0, what="its commit")
            try:
                snap = ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0"))
            except ckpt.CheckpointError as exc:
                seen["changed" if "while it was read" in str(exc) else "empty"] += 1
            else:
                assert same(snap.state, make_state(snap.step % 3, mib=32)), f"step {snap.step} came back mixed"
                seen["whole"] += 1
            return seen["changed"] >= 2

        try:
            wait_for(raced, timeout=120, interval=0, what="reads refused as changed while the worker saves")
        finally:
            header.close()
    finally:
        proc.kill()
        proc.wait()


def test_step_is_an_integer_of_any_kind(shm_dir, monkeypatch):
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    ckpt.save({"x": torch.ones(1)}, torch.tensor(4))
    assert ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0")).step == 4
    for bad in (-1, 1.5, True, "3", 2**63):  # 2**63: the slot's signed 64-bit step (struct.error before)
        with pytest.raises(ValueError, match=r"step must be an int from 0 to 2\*\*63 - 1"):
            ckpt.save({"x": torch.ones(1)}, bad)


def test_save_without_the_agents_directory_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", str(tmp_path / "gone"))
    with pytest.raises(ckpt.CheckpointError, match="is gone"):
        ckpt.save({"x": torch.ones(1)}, 1)
    assert not (tmp_path / "gone").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{NOT_APPLICABLE} no CUDA device here")
def test_cuda_tensors_go_through_a_registered_slot(shm_dir, monkeypatch):
    """CUDA tensors (bf16, strided) are copied into the slot's mapping registered with CUDA, and back."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    base = torch.randn(64, 48, device="cuda")
    state = {"w": torch.randn(999, device="cuda").to(torch.bfloat16), "t": base.t(), "x": [base[::2, 1::3]],
             "cpu": torch.arange(5)}
    ckpt.save(state, 1)
    path = os.path.join(shm_dir, "slots", "0.0")
    assert _shm._SLOTS[path].pinned
    back = ckpt.read_slot(path, map_location=None)
    assert back.state["w"].device.type == "cuda" and back.state["cpu"].device.type == "cpu"
    assert all(torch.equal(back.state[k], state[k]) for k in ("w", "t", "cpu"))
    assert torch.equal(back.state["x"][0], state["x"][0])
    on_cpu = ckpt.read_slot(path)
    assert on_cpu.state["t"].device.type == "cpu" and torch.equal(on_cpu.state["t"], state["t"].cpu())


def test_map_location_as_a_function_is_called_as_torch_load_calls_it(shm_dir, monkeypatch, tmp_path):
    """``map_location(storage, location)``: the tensor lands in the storage it returns, or where it was saved
    when it returns None, for a snapshot as for ``torch.load`` of the same state."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    state = {"w": torch.randn(4, 3), "b": [torch.arange(7, dtype=torch.int16)], "n": 5}
    ckpt.save(state, 1)
    path = os.path.join(shm_dir, "slots", "0.0")
    torch.save(state, tmp_path / "ref.pt")
    for fn in (lambda storage, loc: storage, lambda storage, loc: None, lambda storage, loc: storage.clone()):
        seen, ref_seen = [], []
        back = ckpt.read_slot(path, map_location=lambda s, loc: (seen.append((loc, s.nbytes())), fn(s, loc))[1])
        ref = torch.load(tmp_path / "ref.pt", weights_only=False,
                         map_location=lambda s, loc: (ref_seen.append((loc, s.nbytes())), fn(s, loc))[1])
        assert sorted(seen) == sorted(ref_seen) == sorted([("cpu", 48), ("cpu", 14)])
        assert back.state["n"] == 5 and same(back.state, state) and same(ref, state)
        assert back.state["w"].device == ref["w"].device == torch.device("cpu")
    moved = torch.empty(12).untyped_storage()
    back = ckpt.read_slot(path, map_location=lambda s, loc: moved if s.nbytes() == 48 else None)
    assert back.state["w"].untyped_storage().data_ptr() == moved.data_ptr()  # the storage returned, as torch does
    assert back.state["w"].shape == (4, 3) and torch.equal(back.state["b"][0], state["b"][0])


def test_unpicklable_leaf_names_its_key_path(shm_dir, monkeypatch):
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    ckpt.save({"w": torch.ones(3)}, 1)
    before = committed(shm_dir)
    state = {"model": {"w": torch.ones(3)}, "optimizer": {"param_groups": [{"lr": 0.1, "fn": lambda x: x}]}}
    with pytest.raises(TypeError, match=r"state\['optimizer'\]\['param_groups'\]\[0\]\['fn'\]"):
        ckpt.save(state, 2)
    sparse = {"emb": [torch.ones(2), torch.eye(3).to_sparse()]}
    with pytest.raises(TypeError, match=r"state\['emb'\]\[1\].*dense"):
        ckpt.save(sparse, 2)
    assert committed(shm_dir) == before
    assert not os.path.exists(os.path.join(shm_dir, "slots", "0.1"))


def test_too_large_fails_before_writing(small_shm, monkeypatch):
    """8 MiB tmpfs: two 2 MiB snapshots fit; a 7 MiB one does not (4 MiB free + the 2 its slot holds)."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", small_shm)
    ckpt.save({"x": torch.full((2 << 18,), 1.0)}, 1)  # 2 MiB
    ckpt.save({"x": torch.full((2 << 18,), 2.0)}, 2)
    slots = [os.path.join(small_shm, "slots", n) for n in ("0.0", "0.1")]
    before = [open(p, "rb").read() for p in slots]
    with pytest.raises(ckpt.SnapshotTooLarge) as err:
        ckpt.save({"x": torch.zeros(7 << 18)}, 3)  # 7 MiB
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    assert "needs 7.0 MiB" in str(err.value) and "nothing was overwritten" in str(err.value)
    assert [open(p, "rb").read() for p in slots] == before
    assert committed(small_shm) == {"0.0": 1, "0.1": 2}
    assert torch.equal(ckpt.read_slot(slots[1]).state["x"], torch.full((2 << 18,), 2.0))


def test_fallback_round_trip_layout_and_pruning(tmp_path):
    d = tmp_path / "ck"
    r = run_worker("save", 1, 2, 3, ELAUNCH_CHECKPOINT_DIR=d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(d)) == ["step_000000000002", "step_000000000003"]  # the one before stays
    path = d / "step_000000000003" / "rank_0_of_1.pt"
    payload = torch.load(path, weights_only=False)  # torch alone loads it
    assert {k: payload[k] for k in ("step", "rank", "world_size", "replicated")} == \
        {"step": 3, "rank": 0, "world_size": 1, "replicated": True}
    assert same(payload["state"], make_state(3))
    assert load_result(ELAUNCH_CHECKPOINT_DIR=d) == {"step": 3, "equal": True}
    assert load_result(ELAUNCH_CHECKPOINT_DIR=tmp_path / "none") == {"step": None}


def test_fallback_ignores_a_killed_writers_temp_files(tmp_path):
    """Temporary files of killed writers (step 2's whole but never renamed, step 3's cut short) make no step."""
    d = tmp_path / "ck"
    assert run_worker("save", 1, ELAUNCH_CHECKPOINT_DIR=d).returncode == 0
    whole = (d / "step_000000000001" / "rank_0_of_1.pt").read_bytes()
    for step, data in ((2, whole), (3, whole[:999])):
        (d / f"step_{step:012d}").mkdir()
        (d / f"step_{step:012d}" / f".rank_0_of_1.pt.tmp-{12345 + step}").write_bytes(data)
    assert persisted.newest_complete(str(d))[0] == 1
    assert load_result(ELAUNCH_CHECKPOINT_DIR=d) == {"step": 1, "equal": True}


def test_fallback_sharded_needs_every_rank(tmp_path, monkeypatch):
    """In this process: the fallback reads RANK, WORLD_SIZE and the directory at each call."""
    d = tmp_path / "ck"
    for var in ("ELAUNCH_CHECKPOINT_SHM", "ELAUNCH_CHECKPOINT_RESTORE", "ELAUNCH_CHECKPOINT_STEP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_DIR", str(d))

    def as_rank(rank: int, world: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))

    for rank in (0, 1):
        as_rank(rank, 2)
        ckpt.save(make_state(4, rank), 4, replicated=False)
    as_rank(0, 2)
    ckpt.save(make_state(5, 0), 5, replicated=False)  # rank 1 never saves step 5
    step, files, replicated = persisted.newest_complete(str(d))
    assert (step, sorted(files), replicated) == (4, [0, 1], False)
    as_rank(1, 2)
    snap = ckpt.load()
    assert snap.step == 4 and same(snap.state, make_state(4, 1))
    as_rank(1, 3)
    with pytest.raises(ckpt.CheckpointError, match="world of 2 ranks"):
        ckpt.load()


def test_fallback_ranks_agree_on_one_step(tmp_path):
    """Two 'nodes' with their own directories, one a save behind: both resume from the older step."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_worker("save", 1, 2, 3, ELAUNCH_CHECKPOINT_DIR=a, RANK=0, WORLD_SIZE=2).returncode == 0
    assert run_worker("save", 1, 2, ELAUNCH_CHECKPOINT_DIR=b, RANK=1, WORLD_SIZE=2, CKPT_STATE_RANK=0).returncode == 0
    port = free_port()
    common = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, CKPT_DIST=1, CKPT_STATE_RANK=0)
    procs = [subprocess.Popen([sys.executable, WORKER, "load"], stdout=subprocess.PIPE, text=True,
                              env=worker_env(ELAUNCH_CHECKPOINT_DIR=d, RANK=r, **common))
             for r, d in ((0, a), (1, b))]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [json.loads(o.strip().splitlines()[-1]) for o in outs] == [{"step": 2, "equal": True}] * 2


def _into_case(step: int = 9, mib: float = 1):
    """A state of make_state's structure to load into: twins, a wrong shape, a wrong dtype, a strided twin, extras.

    Returns ``(into, fresh)``: ``fresh`` names the model leaves that must come back as new tensors.
    """
    into = make_state(step, mib=mib)
    m = into["model"]
    m["i8"] = torch.zeros(30, dtype=torch.int8)  # saved: 31 elements
    m["i64"] = torch.zeros(9, dtype=torch.int64)  # saved: (3, 3), as many bytes
    m["fp16"] = torch.zeros(9)  # saved: float16
    m["transposed"] = torch.zeros(16, 12, dtype=torch.float64).t()  # a strided twin of shape (12, 16)
    m["extra"] = torch.zeros(3)  # not saved: left alone
    del m["cplx"]  # saved, not in into: fresh
    return into, {"i8", "i64", "fp16", "cplx"}


def _check_into(snap, into, fresh: set[str], step: int, mib: float = 1) -> None:
    """Bit-identical to make_state(step); twins are into's very tensors, the rest new; into's others untouched."""
    want = make_state(step, mib=mib)
    assert snap.step == step and same({k: v for k, v in snap.state.items() if k != "model"},
                                      {k: v for k, v in want.items() if k != "model"})
    got_m, into_m = snap.state["model"], into["model"]
    assert list(got_m) == list(want["model"]) and all(same(got_m[k], want["model"][k]) for k in want["model"])
    for key, value in got_m.items():
        if key == "big":
            assert all(a is b and a.data_ptr() == b.data_ptr() for a, b in zip(value, into_m["big"]))
        elif key in fresh:
            assert value is not into_m.get(key), key
        else:
            assert value is into_m[key], key
    assert snap.state["model"]["shared"] is snap.state["model"]["same"]
    assert snap.state["optim"]["state"][0]["exp_avg"] is into["optim"]["state"][0]["exp_avg"]
    assert snap.state["pair"].left is into["pair"].left
    untouched = {"i8": torch.zeros(30, dtype=torch.int8), "i64": torch.zeros(9, dtype=torch.int64),
                 "fp16": torch.zeros(9), "extra": torch.zeros(3)}
    assert all(torch.equal(into_m[key], value) for key, value in untouched.items())


@pytest.mark.parametrize("where", ["slot", "slot-large", "persisted", "fallback"])
def test_load_into_fills_the_given_tensors_in_place(where, shm_dir, tmp_path, monkeypatch):
    """ckpt.load(into=...): every twin (key path, shape, dtype) receives the saved bytes and is returned itself.

    ``slot-large``: 8 MiB tensors, read in parts on 2 threads.
    """
    mib = 64 if where == "slot-large" else 1
    if where == "fallback":
        monkeypatch.setenv("ELAUNCH_CHECKPOINT_DIR", str(tmp_path / "ck"))
        ckpt.save(make_state(3), 3)
    else:
        monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
        ckpt.save(make_state(3, mib=mib), 3)
        path = os.path.join(shm_dir, "slots", "0.0")
        if where == "persisted":
            path = persisted.write_rank_file(str(tmp_path / "ck"), 3, 0, 1, True, make_state(3))
        monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", path)
        monkeypatch.setenv("ELAUNCH_CHECKPOINT_STEP", "3")
    into, fresh = _into_case(mib=mib)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        snap = ckpt.load(into=into)
    finally:
        torch.set_num_threads(threads)
    _check_into(snap, into, fresh, 3, mib=mib)


def test_load_into_keeps_parameters_and_their_storage(shm_dir, monkeypatch):
    """Saved nn.Parameters restored into model.state_dict()'s tensors: the model's own memory, not new Parameters."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    torch.manual_seed(0)
    saved = torch.nn.Linear(300, 200)
    ckpt.save({"model": dict(saved.named_parameters()), "n": 1}, 5)
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", os.path.join(shm_dir, "slots", "0.0"))
    model = torch.nn.Linear(300, 200)
    into = {"model": model.state_dict()}
    snap = ckpt.load(into=into)
    assert snap.state["n"] == 1 and snap.state["model"]["weight"] is into["model"]["weight"]
    assert snap.state["model"]["weight"].data_ptr() == model.weight.data_ptr()
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    assert not isinstance(snap.state["model"]["bias"], torch.nn.Parameter)
    # without into: Parameters again, on new memory
    plain = ckpt.load()
    assert isinstance(plain.state["model"]["weight"], torch.nn.Parameter)
    assert plain.state["model"]["weight"].data_ptr() != model.weight.data_ptr()


def test_load_into_racing_a_writer_is_one_whole_step_or_an_error(shm_dir, monkeypatch):
    """A reader loading into the same tensors while a worker saves without pause: a whole step, or CheckpointError.

    The worker saves 3 states in turn (see the test above). Loads of slot 0.0 start in
    turn just after a commit of 0.1 (the worker turns to overwrite 0.0: mostly refused)
    and just after a commit of 0.0 (the worker writes 0.1 meanwhile: mostly whole); both
    outcomes must be seen.
    """
    proc = subprocess.Popen([sys.executable, WORKER, "loop", "1"], stdout=subprocess.DEVNULL, text=True,
                            env=worker_env(ELAUNCH_CHECKPOINT_SHM=shm_dir, CKPT_MIB=32, CKPT_CYCLE=3))
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", os.path.join(shm_dir, "slots", "0.0"))
    into = make_state(7, mib=32)
    big = list(into["model"]["big"])
    seen = {"whole": 0, "changed": 0, "empty": 0}
    headers = []
    try:
        for name in ("0.0", "0.1"):
            path = os.path.join(shm_dir, "slots", name)
            wait_for(lambda: slotfile.read_info(path), timeout=60, what=f"the worker's save into {name}")
            with open(path, "rb") as f:
                headers.append(mmap.mmap(f.fileno(), slotfile.HEADER_SIZE, prot=mmap.PROT_READ))

        def raced():
            header = headers[sum(seen.values()) % 2]
            wait_for(lambda: slotfile.seq_of(header) % 2, timeout=30, interval=0, what="a write")
            wait_for(lambda: slotfile.seq_of(header) % 2 == 0, timeout=30, interval=0, what="its commit")
            try:
                snap = ckpt.load(into=into)
            except ckpt.CheckpointError as exc:
                seen["changed" if "while it was read" in str(exc) else "empty"] += 1
            else:
                assert snap.state["model"]["big"][0] is big[0]
                assert same(snap.state, make_state(snap.step % 3, mib=32)), f"step {snap.step} came back mixed"
                seen["whole"] += 1
            return seen["changed"] >= 2 and seen["whole"] >= 2

        try:
            wait_for(raced, timeout=120, interval=0, what="whole loads and loads refused as changed")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; seen {seen}") from None
    finally:
        for header in headers:
            header.close()
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{NOT_APPLICABLE} no CUDA device here")
def test_load_into_cuda_tensors(shm_dir, monkeypatch):
    """CUDA twins (contiguous and strided) are filled from the registered mapping; a CPU twin by preadv."""
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    base = torch.randn(64, 48, device="cuda")
    state = {"w": torch.randn(999, device="cuda").to(torch.bfloat16), "t": base.t(), "cpu": torch.arange(5)}
    ckpt.save(state, 1)
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_RESTORE", os.path.join(shm_dir, "slots", "0.0"))
    into = {"w": torch.zeros(999, device="cuda", dtype=torch.bfloat16),
            "t": torch.zeros(64, 48, device="cuda").t(), "cpu": torch.zeros(5, dtype=torch.int64)}
    snap = ckpt.load(into=into)
    assert all(snap.state[k] is into[k] and torch.equal(into[k], state[k]) for k in state)
