"""DistributedDataParallel training of a small MLP on scikit-learn's digits dataset.

Runs unchanged under ``torchrun`` and ``elaunch``::

    torchrun --standalone --nproc-per-node=2 examples/ddp_digits.py
    elaunch  --standalone --nproc-per-node=2 examples/ddp_digits.py

Data: ``sklearn.datasets.load_digits`` (1,797 8x8 images bundled with
scikit-learn, no download), split 80/20 with a fixed seed, features scaled.
Backend: gloo on CPU, nccl when CUDA is available (device ``cuda:LOCAL_RANK``, modulo the
GPUs there are: with fewer GPUs than ranks, ranks share them, as ``scripts/gpu_shared.py``
runs two ranks on one GPU).

Checkpoints. Rank 0 writes one atomically (temporary file, then ``os.replace``)
after every epoch, every ``--save-every`` steps, and on a preemption notice; every
rank loads it on start, so a restarted group resumes where it stopped. A
checkpoint holds the model, the optimizer, the epoch, the steps done within the
next epoch and the torch RNG state; the data order of an epoch is a function of
``(--seed, epoch)`` (``DistributedSampler.set_epoch``), and a mid-epoch resume
skips the steps already done. So a run interrupted any number of times ends with
parameters bit-identical to an uninterrupted run with the same seed and world
size (``--final-params`` writes their SHA-256 to compare).

Signals (the decision is all-reduced at every step boundary, so all ranks act on
the same step, whichever rank received the signal):

* SIGUSR1, SIGUSR2 (a notice, e.g. Slurm's preemption warning, which elaunch's
  ``--forward-signals`` passes on): rank 0 saves a checkpoint, prints
  ``preemption notice (SIGUSR1): checkpoint saved at epoch E step S`` (S steps of
  epoch E done), and training continues.
* SIGTERM: the same save and line, then every rank kills itself with SIGTERM
  (default action): the exit status is what a worker killed by SIGTERM shows
  (-15, shell 143), never 0, so no launcher mistakes a stopped run for a finished
  one (a launcher that sent the SIGTERM is stopping anyway; otherwise it sees a
  failed worker and, with restarts left, the new group resumes from that step).
  A rank that reaches no step boundary within ``--stop-grace`` seconds (default
  10; e.g. blocked in a collective with a dead or hung peer) dies of SIGTERM then.
  A rank that is already failing (an exception left the training loop, e.g. a
  peer died mid all-reduce) has nothing left to save: a SIGTERM received before
  or during its exit ends it at once, as it would a script without a handler,
  instead of waiting for the interpreter's teardown (seconds with a large model).

In-memory snapshots (``elaunch.checkpoint``). Under elaunch every rank also saves
its state with ``ckpt.save`` after every step (``--snapshot-every``): a copy into the
agent's shared memory, a few milliseconds, that survives the worker's death. A new
group restores with ``ckpt.load()``, which returns the same step on every rank (the
job agrees on it; ``into`` the model's own tensors, once the model is built), so a
crash costs the steps since the last snapshot, not since the last disk checkpoint.
The state is saved as replicated (DDP: the same on every rank), so a restore hands
every rank the same snapshot, the lowest rank's; the one per-rank entry, the torch RNG
state, is saved for every rank (gathered) and each rank takes its own back.
Under torchrun (no agent to keep the copy) snapshots are off
unless ``--snapshot-every`` asks for them; then ``ckpt`` writes to
``$ELAUNCH_CHECKPOINT_DIR``. The disk checkpoint is still written (rank 0, every
epoch) unless ``--no-disk-checkpoint``; a snapshot, when there is one, is newer.
``--state-mib MIB`` adds a frozen parameter so the state is about MIB MiB (the
goodput benchmark's large model); the training and its result are otherwise the same.

In-process restart (``--in-process``, elaunch only): ``train`` is wrapped with
``elaunch.restartable``. On a fault (a rank killed, or one whose training raised)
the surviving ranks keep their processes: their round is interrupted, and they
run ``train`` again in the next round, with its ranks and store, restoring the
snapshot the job agreed on; only a dead rank gets a new process. Everything the
round needs (the process group, the data, the model, DDP) is built inside ``train``.
A survivor's new model takes over the tensors of its last round's model before the
restore copies the agreed step into them: memory already in use, where a new model's
256 MiB would be faulted in page by page (a second of CPU on each survivor, beside the
replacement's own restore). Under torchrun, or with no launcher, the flag changes nothing.

Hang detection and the goodput ledger: ``elaunch.progress(step=...)`` is called
every step with the job's step count since the start (the same on every attempt),
when elaunch is importable (a no-op otherwise, and under torchrun); after a
restart, the time until the job is back at the step it had reached counts as
restoring (docs/metrics.md).

Fault injection: ``--crash-rank R --crash-epoch E`` makes rank R raise at the
start of epoch E on the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``).
``--crash-at R:E:S,...`` is a schedule: its k-th entry makes rank R raise before
step S (0-based) of epoch E on attempt k (``TORCHELASTIC_RESTART_COUNT == k``).
``--hang-at R:E:S[:block],...`` schedules hangs the same way: on attempt k rank R
calls ``elaunch.progress()`` for step S of epoch E, then stops itself with SIGSTOP
(or, with ``:block``, sleeps forever; it still dies of SIGTERM after
``--stop-grace``), for ``--hang-timeout`` to find. In both schedules an entry
``none`` means "no fault on this attempt", so crashes and hangs can alternate:
``--crash-at 1:1:7,none,0:2:3 --hang-at none,0:1:12``. ``--crash-file PATH`` is a crash injected from
outside, at a time the injector picks (benchmarks): when PATH holds a global rank R, rank R renames
it away (so it fires once) and raises before its next step, on any attempt.

Output (rank 0): one line per epoch, ``epoch 3/20 loss 0.123 test_acc 0.961
restart 0``, then ``final test accuracy: 0.97``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

# A large state (--state-mib) is restored into new tensors after every restart. In transparent huge
# pages (torch's THP_MEM_ALLOC_ENABLE; read at the first large allocation, so set before any) the
# kernel faults 256 MiB in 128 steps instead of 65,536: about 3x faster on a 2-core machine.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

try:
    from elaunch.errors import record
except ImportError:  # elaunch not installed: torch's decorator writes the same file
    from torch.distributed.elastic.multiprocessing.errors import record

CHECKPOINT_FORMAT = "elaunch-example-ddp_digits/2"
#: Older checkpoints (epoch boundaries only) still resume.
CHECKPOINT_FORMATS = ("elaunch-example-ddp_digits/1", CHECKPOINT_FORMAT)
#: Seed of the train/test split (the dataset itself; --seed drives the training).
SPLIT_SEED = 0
#: Signal -> code all-reduced with MAX at each step boundary (a stop outranks a notice).
NOTICE_CODES = {signal.SIGUSR1: 1, signal.SIGUSR2: 2, signal.SIGTERM: 3}
STOP_CODE = 3
#: A --crash-at/--hang-at entry for an attempt without that fault.
NO_FAULT = "none"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20, help="epochs to train (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=64, help="hidden layer width (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order (default 0)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="directory for the checkpoint (default ./runs/ddp_digits-$TORCHELASTIC_RUN_ID)",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint path (default RUN_DIR/checkpoint.pt)")
    p.add_argument("--save-every", type=int, default=0, metavar="STEPS",
                   help="also checkpoint every STEPS optimizer steps (default 0: at epoch ends only)")
    p.add_argument("--snapshot-every", type=int, default=None, metavar="STEPS",
                   help="ckpt.save the state every STEPS steps (default: 1 under elaunch, 0 = off elsewhere)")
    p.add_argument("--no-disk-checkpoint", action="store_true",
                   help="write no disk checkpoint (restores come from snapshots only)")
    p.add_argument("--state-mib", type=int, default=0, metavar="MIB",
                   help="add a frozen parameter so the model's state is about MIB MiB (default 0: none)")
    p.add_argument("--final-params", default=None, metavar="FILE",
                   help="rank 0 writes the SHA-256 of the final parameters to FILE (JSON)")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="sleep SECONDS after every step: a longer run, the same results (fault tests)")
    p.add_argument("--stop-grace", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, die of it within SECONDS even without reaching a step boundary "
                        "(default 10)")
    p.add_argument("--in-process", action="store_true",
                   help="opt in to elaunch's in-process restart (elaunch.restartable): survivors of a fault keep "
                        "their processes")
    p.add_argument("--crash-rank", type=int, default=None, help="global rank that crashes once")
    p.add_argument("--crash-epoch", type=int, default=None, help="epoch (1-based) at whose start it crashes")
    p.add_argument("--crash-at", type=parse_crash_schedule, default=(), metavar="R:E:S,...",
                   help="k-th entry: rank R raises before step S (0-based) of epoch E on attempt k "
                        "(TORCHELASTIC_RESTART_COUNT == k); 'none' = no crash on attempt k")
    p.add_argument("--crash-file", default=None, metavar="PATH",
                   help="when PATH holds a global rank R, rank R renames it away and raises before its next step")
    p.add_argument("--hang-at", type=parse_hang_schedule, default=(), metavar="R:E:S[:block],...",
                   help="k-th entry: on attempt k rank R reports progress for step S of epoch E, then "
                        "stops itself with SIGSTOP (':block': sleeps forever); 'none' = no hang on attempt k")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs={args.epochs}: must be >= 1")
    if args.save_every < 0:
        p.error(f"--save-every={args.save_every}: must be >= 0")
    if not args.step_sleep >= 0:
        p.error(f"--step-sleep={args.step_sleep}: must be >= 0 seconds")
    if not args.stop_grace > 0:
        p.error(f"--stop-grace={args.stop_grace}: must be > 0 seconds")
    if args.snapshot_every is None:
        args.snapshot_every = 1 if os.environ.get("ELAUNCH_CHECKPOINT_SHM") else 0
    if args.snapshot_every < 0:
        p.error(f"--snapshot-every={args.snapshot_every}: must be >= 0")
    if args.state_mib < 0:
        p.error(f"--state-mib={args.state_mib}: must be >= 0")
    if (args.crash_rank is None) != (args.crash_epoch is None):
        p.error("--crash-rank and --crash-epoch go together")
    if args.checkpoint is None:
        run_dir = args.run_dir or os.path.join(
            "runs", f"ddp_digits-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
        )
        args.checkpoint = os.path.join(run_dir, "checkpoint.pt")
    return args


def crash_requested(path: str, rank: int) -> bool:
    """True once for the rank ``path`` names (it renames the file away, so no other rank or step sees it)."""
    try:
        with open(path) as f:
            target = int(f.read().strip())
    except (OSError, ValueError):
        return False
    if target != rank:
        return False
    try:
        os.rename(path, f"{path}.{os.getpid()}.raised")
    except OSError:
        return False
    return True


def parse_crash_schedule(text: str) -> tuple[tuple[int, int, int] | None, ...]:
    """Parse ``R:E:S,none,R:E:S`` into ``((rank, epoch, step), None, ...)`` (entry k: attempt k)."""
    return tuple(None if entry == NO_FAULT else _fault_point(entry) for entry in filter(None, text.split(",")))


def parse_hang_schedule(text: str) -> tuple[tuple[int, int, int, str] | None, ...]:
    """Parse ``R:E:S[:block],none,...`` into ``((rank, epoch, step, "stop" | "block"), None, ...)``."""
    out = []
    for entry in filter(None, text.split(",")):
        if entry == NO_FAULT:
            out.append(None)
            continue
        how = "stop"
        if entry.endswith(":block"):
            entry, how = entry[: -len(":block")], "block"
        out.append((*_fault_point(entry), how))
    return tuple(out)


def _fault_point(entry: str) -> tuple[int, int, int]:
    try:
        rank, epoch, step = (int(x) for x in entry.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{entry!r} is not RANK:EPOCH:STEP (integers) or {NO_FAULT!r}") from None
    if rank < 0 or epoch < 1 or step < 0:
        raise argparse.ArgumentTypeError(f"{entry!r}: need RANK >= 0, EPOCH >= 1, STEP >= 0")
    return rank, epoch, step


def hang_forever(how: str, where: str) -> None:
    """Simulate a hung rank: SIGSTOP itself (``how == "stop"``) or sleep forever (``"block"``)."""
    print(f"injected hang ({how}): {where} (--hang-at)", file=sys.stderr, flush=True)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # only a SIGKILL (or SIGCONT) ends this
    while True:
        time.sleep(3600)


def die_of_sigterm() -> None:
    """End this process as SIGTERM's default action would (status -15, shell 143)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)  # not reached: the signal is delivered before os.kill returns
    os._exit(128 + signal.SIGTERM)


class Notices:
    """Signals received since the last step boundary, as NOTICE_CODES (handlers only append).

    Args:
        stop_grace: seconds after a SIGTERM before the process dies of it even if it
            never reached a step boundary (blocked in a collective with a dead peer).
    """

    def __init__(self, stop_grace: float) -> None:
        self._codes: list[int] = []
        self._stop_grace = stop_grace
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        for sig in NOTICE_CODES:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self._codes.append(NOTICE_CODES[signal.Signals(signum)])
        if signum == signal.SIGTERM and self._timer is None:
            # not "a second SIGTERM kills": a launcher may deliver one stop twice
            # (to the process group and to the pid)
            self._timer = threading.Timer(self._stop_grace, die_of_sigterm)
            self._timer.daemon = True
            self._timer.start()

    def failing(self) -> None:
        """This rank is failing: a stop ends it now, with SIGTERM's default action.

        Called as an exception leaves the training loop. A SIGTERM already received
        ends the process here; a later one no longer waits for a step boundary that
        will not come (nor for the interpreter's teardown: freeing a large model and
        torch's exit handlers take seconds).
        """
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if STOP_CODE in self._codes or self._timer is not None:
            die_of_sigterm()

    def take(self) -> int:
        """Return the highest code received since the last call (0 for none) and forget them."""
        n = len(self._codes)
        code = max(self._codes[:n], default=0)
        del self._codes[:n]  # a signal arriving meanwhile was appended after n: kept
        return code


def progress_function():
    """``elaunch.progress`` when elaunch is importable, else a no-op."""
    try:
        from elaunch import progress
    except ImportError:
        return lambda step=None: None
    return progress


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (x_train, y_train, x_test, y_test); identical on every rank (fixed seed)."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=SPLIT_SEED, stratify=digits.target
    )
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(np.asarray(a), dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


class Ballast(nn.Module):
    """A frozen parameter of about ``mib`` MiB that the forward pass passes by (``--state-mib``).

    It is in ``state_dict()`` (so every snapshot and checkpoint carries it) and in the
    final digest, but not in the optimizer and not in DDP's gradient all-reduce.
    """

    def __init__(self, mib: int) -> None:
        super().__init__()
        # uninitialized until reset_parameters(): a restore overwrites it anyway, and filling
        # 256 MiB took a restarted worker a third of its way to the first step
        self.weight = nn.Parameter(torch.empty(mib * 2**20 // 4), requires_grad=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The initial value (uses no random numbers: the order of initialization keeps the seed's)."""
        torch.arange(self.weight.numel(), dtype=torch.float32, out=self.weight).remainder_(9973)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make_model(hidden: int, state_mib: int = 0) -> nn.Module:
    """The classifier; with ``state_mib`` a :class:`Ballast` first, left uninitialized
    (call :func:`init_ballast` unless a checkpoint or snapshot is restored into it)."""
    layers = [nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)]
    return nn.Sequential(*([Ballast(state_mib)] if state_mib else []), *layers)


def init_ballast(model: nn.Module) -> None:
    """Give the model's Ballast (if any) its initial value."""
    for m in model.modules():
        if isinstance(m, Ballast):
            m.reset_parameters()


#: In-process restart (``--in-process``): the last round's model tensors in this process (``state_dict()``:
#: references, not copies), which the next round's model takes over when a snapshot is restored into them
#: (:func:`adopt`). What they hold does not matter: the restore overwrites every one of them.
_last_model: dict = {}


def adopt(own: dict, last: dict) -> dict | None:
    """The tensors of ``last`` (a state dict of this process's last round) to restore into, in place of
    ``own`` (the new model's ``state_dict()``): a copy of ``last`` when it has exactly ``own``'s entries, shapes,
    dtypes and devices; else None.
    After a restore into them, ``model.load_state_dict(last, assign=True)`` makes them the model's."""
    if list(last) != list(own) or any((t.shape, t.dtype, t.device) != (last[k].shape, last[k].dtype, last[k].device)
                                      for k, t in own.items()):
        return None
    return dict(last)


def snapshots():
    """``elaunch.checkpoint``, or None when elaunch is not importable."""
    try:
        import elaunch.checkpoint as ckpt
    except ImportError:
        return None
    return ckpt


def load_checkpoint(path: str) -> dict | None:
    """Return the checkpoint at ``path`` or None if there is none.

    Raises:
        SystemExit: the file exists but is not this example's checkpoint (we refuse
            to resume from, and later overwrite, an unrelated file).
    """
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise SystemExit(f"--checkpoint {path}: not readable as a checkpoint ({exc}); refusing to overwrite it")
    if not isinstance(state, dict) or state.get("format") not in CHECKPOINT_FORMATS:
        raise SystemExit(f"--checkpoint {path}: not a ddp_digits checkpoint; refusing to overwrite it")
    return state


def save_checkpoint(path: str, state: dict) -> None:
    """Write ``state`` atomically: a temporary file in the same directory, then ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fp:
            torch.save(state, fp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def params_digest(model: nn.Module) -> str:
    """SHA-256 (hex) over the parameters' names, shapes, dtypes and raw bytes, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return (pred == y).float().mean().item()


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    notices = Notices(args.stop_grace)
    notices.install()  # before anything slow: a notice during start-up is acted on at step 0
    run = train
    if args.in_process:
        import elaunch

        run = elaunch.restartable(train)  # plain train() where elaunch offers no control channel
    try:
        run(args, notices)
    except BaseException:
        notices.failing()
        raise


def train(args: argparse.Namespace, notices: Notices) -> None:
    """Join the group, restore the newest state, train ``args.epochs`` epochs."""
    progress = progress_function()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    ckpt = snapshots() if args.snapshot_every else None
    # Read (and vet) the checkpoint before joining the group: a bad path fails fast.
    state, source = load_checkpoint(args.checkpoint), args.checkpoint
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash_at = args.crash_at[restart] if restart < len(args.crash_at) else None
    hang_at = args.hang_at[restart] if restart < len(args.hang_at) else None
    torch.manual_seed(args.seed)

    x_tr, y_tr, x_te, y_te = load_data()
    x_tr, y_tr, x_te, y_te = x_tr.to(device), y_tr.to(device), x_te.to(device), y_te.to(device)
    sampler = DistributedSampler(x_tr, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)

    model = make_model(args.hidden, args.state_mib).to(device)
    # A snapshot is newer than any disk checkpoint: the job agreed on its step. Its model
    # tensors are copied straight into the model's own (no new memory to fault in), or, in a
    # survivor of an in-process restart, into its last round's, which the new model then takes.
    own = model.state_dict()
    last = adopt(own, _last_model) if args.in_process and _last_model else None
    snap = ckpt.load(map_location=device, into={"model": own if last is None else last}) if ckpt is not None else None
    _last_model.clear()
    if snap is not None:
        state, source = snap.state, f"snapshot of step {snap.step}"
        if last is not None and all(state["model"][k] is t for k, t in last.items()):
            model.load_state_dict(last, assign=True)  # every tensor restored in place: the new model takes them
            own = model.state_dict()
    if args.in_process:
        _last_model.update(own)
    # built after the restore: an assign above gives the model new Parameter objects
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    # position: `done_epochs` epochs complete, then `done_steps` steps of the next one;
    # `partial` is the all-reduced (loss sum, samples) of those steps, for the epoch line
    done_epochs, done_steps, partial = 0, 0, torch.zeros(2)
    if state is None:
        init_ballast(model)  # nothing restored into it
    if state is not None:
        if list(state["model"]) != list(own) or any(state["model"][k] is not t for k, t in own.items()):
            model.load_state_dict(state["model"])  # not restored in place (a disk checkpoint)
        optimizer.load_state_dict(state["optimizer"])
        done_epochs, done_steps = state["epoch"], state.get("step", 0)
        if "rngs" in state:  # a snapshot: every rank's RNG state, gathered (see the save below)
            rngs = state["rngs"].cpu()  # map_location moved it too
            # clone: set_rng_state of a row view (a storage offset) segfaults (torch 2.13, CPU)
            torch.set_rng_state(rngs[rank if state.get("world_size") == world else 0].clone())
        elif "rng" in state:  # a disk checkpoint: rank 0's, for every rank
            torch.set_rng_state(state["rng"].cpu())
        if done_steps and state.get("world_size") != world:
            if rank == 0:
                print(f"world size changed ({state.get('world_size')} -> {world}): "
                      f"epoch {done_epochs + 1} restarts from its first step", flush=True)
            done_steps = 0
        elif done_steps and "partial" in state:  # none in a snapshot: the epoch line covers the steps since
            partial = state["partial"]
    # Every rank read the file; make sure all start from rank 0's position.
    pos = torch.tensor([done_epochs, done_steps], device=device)
    dist.broadcast(pos, src=0)
    done_epochs, done_steps = (int(v) for v in pos.tolist())
    if rank == 0 and state is not None:
        where = f"at epoch {done_epochs + 1} step {done_steps}" if done_steps else f"after epoch {done_epochs}"
        print(f"resumed from {source} {where}", flush=True)
    # find_unused_parameters=True: DDP then keeps the gradient buckets of its first step instead of
    # rebuilding them, so a group resumed mid-run sums each gradient in the same order as an
    # uninterrupted run (at 3 or more ranks that order changes the rounding: resumed runs were not
    # bit-identical). The cost: one walk of this small graph per step, and one warning per rank.
    # After a snapshot restore every rank holds the same state (the job agreed on one step, the
    # same on every rank), so DDP need not broadcast rank 0's weights again: with a large model
    # that broadcast is most of a restart (256 MiB from rank 0 on every restart). A disk
    # checkpoint may exist on rank 0's host only: then DDP broadcasts, as it does on a fresh start.
    skip_sync = snap is not None and "init_sync" in inspect.signature(DDP.__init__).parameters  # torch >= 2.5
    ddp = DDP(model, device_ids=[device.index] if use_cuda else None, find_unused_parameters=True,
              **({"init_sync": False} if skip_sync else {}))
    loss_fn = nn.CrossEntropyLoss()

    def checkpoint(epochs: int, steps: int, total: torch.Tensor) -> None:
        """Rank 0 saves position (epochs complete, steps of the next); ``total`` already reduced."""
        if rank == 0 and not args.no_disk_checkpoint:
            save_checkpoint(args.checkpoint, {
                "format": CHECKPOINT_FORMAT, "epoch": epochs, "step": steps, "world_size": world,
                "seed": args.seed, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(), "partial": total.cpu(),
            })

    for epoch in range(done_epochs + 1, args.epochs + 1):
        if restart == 0 and epoch == args.crash_epoch:
            # every rank waits here until rank 0 has saved the last epoch's checkpoint,
            # so the injected crash cannot cut that save short
            dist.barrier()
            if rank == args.crash_rank:
                raise RuntimeError(f"injected crash: rank {rank} at epoch {epoch} (--crash-rank/--crash-epoch)")
        sampler.set_epoch(epoch)  # the epoch's order: a function of (seed, epoch) only
        order = torch.tensor(list(sampler), dtype=torch.long, device=device)
        batches = order.split(args.batch_size)
        first = done_steps if epoch == done_epochs + 1 else 0
        # sum of losses, number of samples; rank 0 carries the resumed part of the epoch
        total = (partial.to(device) if first and rank == 0 else torch.zeros(2)).to(device)
        for step in range(first, len(batches)):
            progress(step=(epoch - 1) * len(batches) + step)  # steps since the start: same on every attempt
            if crash_at == (rank, epoch, step) or args.crash_file and crash_requested(args.crash_file, rank):
                raise RuntimeError(f"injected crash: rank {rank} at epoch {epoch} step {step} "
                                   f"on attempt {restart} (--crash-at or --crash-file)")
            if hang_at is not None and hang_at[:3] == (rank, epoch, step):
                hang_forever(hang_at[3], f"rank {rank} at epoch {epoch} step {step} on attempt {restart}")
            code = torch.tensor([notices.take()], device=device)
            dist.all_reduce(code, op=dist.ReduceOp.MAX)  # every rank acts on the same step
            code = int(code.item())
            position = (epoch - 1) * len(batches) + step  # steps since the start: same on every attempt
            periodic = args.save_every and step != first and position % args.save_every == 0
            if code or periodic:
                reduced = total.clone()
                dist.all_reduce(reduced)
                checkpoint(epoch - 1, step, reduced)
                if code and rank == 0:
                    name = next(s.name for s, c in NOTICE_CODES.items() if c == code)
                    print(f"preemption notice ({name}): checkpoint saved at epoch {epoch} step {step}", flush=True)
                if code == STOP_CODE:
                    dist.barrier()  # nobody leaves before rank 0's checkpoint is on disk
                    die_of_sigterm()  # a stop, not a success: exit as a SIGTERM-killed worker would
            idx = batches[step]
            xb, yb = x_tr[idx], y_tr[idx]
            optimizer.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(yb), torch.tensor(float(len(yb)), device=device)])
            if ckpt is not None and (position + 1) % args.snapshot_every == 0:
                # position + 1 steps done: the model and optimizer are the same on every rank (DDP), so
                # the state is saved as replicated, and a restore hands every rank one snapshot (the
                # lowest rank's). The RNG state is a rank's own: every rank's goes in, gathered, and
                # each rank takes its own back (rank 0's when the world size changed).
                at = (epoch, 0) if step + 1 == len(batches) else (epoch - 1, step + 1)
                rng = torch.get_rng_state().to(device)
                rngs = [torch.empty_like(rng) for _ in range(world)]
                dist.all_gather(rngs, rng)
                ckpt.save({"format": CHECKPOINT_FORMAT, "epoch": at[0], "step": at[1], "world_size": world,
                           "seed": args.seed, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "rngs": torch.stack(rngs)}, step=position + 1)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        dist.all_reduce(total)
        if rank == 0:
            acc = accuracy(model, x_te, y_te)
            print(
                f"epoch {epoch}/{args.epochs} loss {(total[0] / total[1]).item():.3f} "
                f"test_acc {acc:.3f} restart {restart}",
                flush=True,
            )
        checkpoint(epoch, 0, torch.zeros(2))

    if rank == 0:
        print(f"final test accuracy: {accuracy(model, x_te, y_te):.2f}", flush=True)
        if args.final_params:
            with open(args.final_params, "w") as fp:
                json.dump({"sha256": params_digest(model), "epochs": args.epochs, "world_size": world,
                           "seed": args.seed}, fp)
                fp.write("\n")
    dist.barrier()
    # DDP's reducer holds the process group (in reference cycles): free it now, so the
    # group's C++ threads are torn down here and not during interpreter shutdown,
    # where gloo can abort ("terminate called without an active exception").
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
