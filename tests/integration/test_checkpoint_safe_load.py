"""Loading a snapshot never runs code from it, whoever wrote it (issue 35, item 1).

A forged snapshot whose structure pickles ``os.system`` (the attack a writable replica
directory allowed) is put where a worker loads from: a slot file written byte by byte
in the documented layout (:mod:`elaunch.checkpoint.slotfile`), and a persisted ``*.pt``
file. Real worker processes load them (``tests/scripts/ckpt_roundtrip.py load``); the
payload's marker file must never appear and the error must name the global. A user's
class loads once allowed with ``torch.serialization.add_safe_globals``; the states
people save (optimizers, schedulers, a model's ``state_dict``, a Lightning checkpoint)
load with no change.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import mmap
import os
import pickle
import sys

import pytest

torch = pytest.importorskip("torch")

import elaunch.checkpoint as ckpt  # noqa: E402
from elaunch.checkpoint import _read, _shm, persisted, slotfile  # noqa: E402
from tests.integration.test_checkpoint_worker import load_result, run_worker, shm_dir  # noqa: E402,F401
from tests.conftest import SCRIPTS  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
from ckpt_roundtrip import same  # noqa: E402


class Payload:
    """What an attacker pickles: unpickling it calls ``os.system`` (plain pickle does; weights-only must not)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def forge_slot(path: str, state, *, step: int = 5, protocol: int = 2) -> None:
    """Write ``state`` pickled plainly as the meta of a committed slot, as a worker's save lays a slot out."""
    meta = pickle.dumps(state, protocol=protocol)
    size = slotfile.file_size(len(meta), 0)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as buf:
            seq = slotfile.begin(buf)
            buf[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
            slotfile.commit(buf, seq, step=step, rank=0, world_size=1, replicated=True, meta_len=len(meta),
                            data_len=0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_forged_slot_runs_no_code_in_a_restored_worker(shm_dir, tmp_path, protocol):
    marker = tmp_path / "pwned"
    path = os.path.join(shm_dir, "replicas", "r0")
    forge_slot(path, {"model": {"w": 1}, "x": Payload(marker)}, protocol=protocol)
    assert slotfile.read_info(path).step == 5  # a committed snapshot, as the agent would hand it over
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=path, ELAUNCH_CHECKPOINT_STEP=5)
    assert not marker.exists(), "loading the forged snapshot ran its code"
    assert path in got["error"] and "weights-only" in got["error"] and got["class"] == "UnsafeStateError"
    if protocol == 2:  # the scanner reads protocol 2, what ckpt.save writes: it names the global
        assert "posix.system" in got["error"] and "cannot be allowed" in got["error"], got["error"]
    # the same in this process, with and without `into` (the structure is unpickled twice then)
    for into in (None, {"model": {"w": torch.ones(1)}}):
        with pytest.raises(ckpt.UnsafeStateError) as err:
            _read.read(path, into=into)
        assert isinstance(err.value, pickle.UnpicklingError)  # what torch.load(weights_only=True) raises
        assert not marker.exists()


def test_a_forged_persisted_file_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ck"
    path = persisted.rank_file(str(d), 4, 0, 1)
    os.makedirs(os.path.dirname(path))
    torch.save({"step": 4, "rank": 0, "world_size": 1, "replicated": True,
                "state": {"w": torch.ones(2), "x": Payload(marker)}}, path)
    # the agent restores from it, and the no-launcher fallback finds it in ELAUNCH_CHECKPOINT_DIR
    for env in ({"ELAUNCH_CHECKPOINT_SHM": str(tmp_path), "ELAUNCH_CHECKPOINT_RESTORE": path,
                 "ELAUNCH_CHECKPOINT_STEP": 4}, {"ELAUNCH_CHECKPOINT_DIR": str(d)}):
        got = load_result(**env)
        assert not marker.exists(), f"loading the forged file ran its code ({env})"
        assert path in got["error"] and "posix.system" in got["error"] and "weights-only" in got["error"], got
    assert persisted.newest_complete(str(d))[0] == 4  # its flag is read without unpickling it
    assert not marker.exists()


def test_a_class_not_allowed_is_named_with_how_to_allow_it(shm_dir):
    """The saver allowed its namedtuple, the loader did not: the error names it and add_safe_globals."""
    r = run_worker("save", 2, ELAUNCH_CHECKPOINT_SHM=shm_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    path = os.path.join(shm_dir, "slots", "0.0")
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=path, ELAUNCH_CHECKPOINT_STEP=2,
                      CKPT_NO_ALLOW=1)
    assert "ckpt_roundtrip.Pair" in got["error"], got
    assert "torch.serialization.add_safe_globals([ckpt_roundtrip.Pair])" in got["error"], got
    # the same loader, allowing it, restores the state
    got = load_result(ELAUNCH_CHECKPOINT_SHM=shm_dir, ELAUNCH_CHECKPOINT_RESTORE=path, ELAUNCH_CHECKPOINT_STEP=2)
    assert got == {"step": 2, "equal": True}


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = "main"


@dataclasses.dataclass
class TrainConfig:
    lr: float
    phase: Phase
    scale: torch.Tensor


def test_a_users_classes_save_and_load_once_allowed(shm_dir, monkeypatch):
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    state = {"cfg": TrainConfig(0.1, Phase.MAIN, torch.full((3,), 2.0)), "w": torch.ones(2)}
    with pytest.raises(TypeError) as err:  # at the save, not at the restore; nothing written
        ckpt.save(state, 1)
    msg = str(err.value)
    assert "state['cfg'] (a TrainConfig)" in msg and f"{__name__}.TrainConfig" in msg
    assert "add_safe_globals" in msg and "Nothing was written" in msg
    assert not os.path.exists(os.path.join(shm_dir, "slots", "0.0"))
    with torch.serialization.safe_globals([TrainConfig, Phase]):
        ckpt.save(state, 1)
        back = ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0")).state
    assert back["cfg"].phase is Phase.MAIN and back["cfg"].lr == 0.1 and torch.equal(back["cfg"].scale, state["cfg"].scale)
    with pytest.raises(ckpt.UnsafeStateError, match=rf"{__name__}.TrainConfig.*add_safe_globals"):
        ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0"))  # the context ended: not allowed any more


def test_a_malformed_tensor_reference_is_refused(shm_dir, tmp_path):
    """A persistent id that is not elaunch's reference, or points past the data, makes no tensor."""
    path = os.path.join(shm_dir, "replicas", "r1")

    class Ref:
        def __init__(self, pid):
            self.pid = pid

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.pid if isinstance(obj, Ref) else None

    for pid in [("storage", "elaunch.t2", 0, 1 << 40, "uint8", (1 << 40,), "cpu", 0, 0),
                ("storage", "elaunch.t2", 0, 4, "os.system", (1,), "cpu", 0, 0),
                ("storage", "Float", "0", "cpu", 4)]:  # torch.save's own storage id
        import io
        buf = io.BytesIO()
        P(buf, protocol=2).dump({"t": Ref(pid)})
        meta = buf.getvalue()
        size = slotfile.file_size(len(meta), 0)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
            seq = slotfile.begin(mm)
            mm[slotfile.META_AT:slotfile.META_AT + len(meta)] = meta
            slotfile.commit(mm, seq, step=1, rank=0, world_size=1, replicated=True, meta_len=len(meta), data_len=0)
        with pytest.raises(ckpt.UnsafeStateError, match="reference"):
            ckpt.read_slot(path)


# ------------------------------------------------------------------ the states people save load unchanged


def _model_and_optimizers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optims = {name: cls(model.parameters(), **kw) for name, cls, kw in [
        ("adam", torch.optim.Adam, {"lr": 1e-3}), ("adamw", torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True}),
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("rmsprop", torch.optim.RMSprop, {"lr": 1e-2}), ("adagrad", torch.optim.Adagrad, {"lr": 1e-2})]}
    for _ in range(2):
        for opt in optims.values():
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
    return model, optims


def _schedulers(opt):
    s = torch.optim.lr_scheduler
    return {
        "step": s.StepLR(opt, 2), "onecycle": s.OneCycleLR(opt, max_lr=0.1, total_steps=10),
        "cosine_restarts": s.CosineAnnealingWarmRestarts(opt, 3), "plateau": s.ReduceLROnPlateau(opt),
        "lambda": s.LambdaLR(opt, lambda e: 0.9 ** e), "cyclic": s.CyclicLR(opt, 0.01, 0.1),
        "sequential": s.SequentialLR(opt, [s.LinearLR(opt), s.ExponentialLR(opt, 0.9)], milestones=[2]),
        "chained": s.ChainedScheduler([s.ConstantLR(opt), s.ExponentialLR(opt, 0.9)]),
        "polynomial": s.PolynomialLR(opt, 5),
    }


def test_model_optimizer_and_scheduler_states_load_unchanged(shm_dir, monkeypatch):
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    model, optims = _model_and_optimizers()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the schedulers' own (CyclicLR needs momentum)
    scheds = _schedulers(sgd)
    for _ in range(3):
        sgd.step()
        for name, sched in scheds.items():
            sched.step(1.0) if name == "plateau" else sched.step()
    state = {"model": model.state_dict(), "optim": {k: o.state_dict() for k, o in optims.items()},
             "sched": {k: s.state_dict() for k, s in scheds.items()}, "sgd": sgd.state_dict()}
    assert hasattr(state["model"], "_metadata")
    ckpt.save(state, 3)
    back = ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0")).state
    assert same(back, state) and back["model"]._metadata == state["model"]._metadata
    model.load_state_dict(back["model"])
    for name, opt in optims.items():
        opt.load_state_dict(back["optim"][name])
    for name, sched in scheds.items():
        sched.load_state_dict(back["sched"][name])


def test_a_lightning_checkpoint_loads_unchanged(shm_dir, monkeypatch, tmp_path):
    """A real Lightning checkpoint dict (``_checkpoint_connector.dump_checkpoint``) after a short fit."""
    L = pytest.importorskip("lightning")  # the test extra installs it
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self, hidden: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(3, hidden)

        def training_step(self, batch, _):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)

    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, accelerator="cpu", devices=1,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="loss"),
                                   EarlyStopping(monitor="loss", patience=3)])
    trainer.fit(Tiny())
    state = trainer._checkpoint_connector.dump_checkpoint()
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"} <= set(state)
    monkeypatch.setenv("ELAUNCH_CHECKPOINT_SHM", shm_dir)
    ckpt.save(state, 2)
    back = ckpt.read_slot(os.path.join(shm_dir, "slots", "0.0")).state
    assert same(back, state)
