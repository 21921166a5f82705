"""examples/ddp_digits.py under torch's own launcher: validates the example apart from elaunch.

Runs ``python -m torch.distributed.run --standalone --nproc-per-node=2`` (torchrun
of the installed torch) in a tmp dir.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES

EXAMPLE = str(EXAMPLES / "ddp_digits.py")
TIMEOUT = 180.0  # seconds; a normal run takes ~6-10 s on 2 cores

pytestmark = pytest.mark.slow


def torchrun(args: list[str], cwd, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run torchrun in its own session; on timeout kill the whole tree, then fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT}s:\n{out.decode(errors='replace')[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"), "")


def diagnose(out: str) -> str:
    """The output's tail, plus any faulthandler report (it can be long and early)."""
    lines = out.splitlines()
    fatal = [i for i, line in enumerate(lines) if "Fatal Python error" in line]
    parts = ["\n".join(lines[i : i + 40]) for i in fatal[:2]]
    return "\n...\n".join(parts + [out[-4000:]])


def epochs_seen(out: str) -> list[tuple[int, int]]:
    """(epoch, restart) of every epoch line rank 0 printed.

    Not anchored at the line start: under torchrun the workers' and the agent's
    output share one stream, and a C++ warning written in pieces can put text
    in front of rank 0's line (seen once in CI).
    """
    return [(int(e), int(r)) for e, r in re.findall(r"epoch (\d+)/\d+ loss [\d.]+ test_acc [\d.]+ restart (\d+)$", out, re.M)]


def test_trains_to_95_percent_under_torchrun(tmp_path):
    res = torchrun([EXAMPLE], cwd=tmp_path)
    assert res.returncode == 0, diagnose(res.stdout)
    match = re.search(r"^final test accuracy: (\d\.\d\d)$", res.stdout, re.M)
    assert match, diagnose(res.stdout)
    assert float(match.group(1)) >= 0.95, diagnose(res.stdout)
    assert epochs_seen(res.stdout) == [(e, 0) for e in range(1, 21)]
    # default checkpoint: under ./runs/ddp_digits-<run id>/ of the working directory
    runs = list((tmp_path / "runs").glob("ddp_digits-*/checkpoint.pt"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))


@pytest.mark.long  # in the long part (scripts/test.sh --long): the suite took 19:54 of its 20 minutes on a fresh machine
def test_crash_once_then_resume_from_checkpoint_under_torchrun(tmp_path):
    # torch >= 2.5 shares the rendezvous store with the workers, and a restarted gloo
    # group can read the previous attempt's addresses and hang (pytorch#135712);
    # elaunch gives every round a fresh store. Opt torchrun out of sharing here.
    ckpt = tmp_path / "ck" / "digits.pt"
    res = torchrun(
        ["--max-restarts=1", EXAMPLE, "--epochs=5", "--crash-rank=1", "--crash-epoch=3", f"--checkpoint={ckpt}"],
        cwd=tmp_path,
        extra_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    assert res.returncode == 0, diagnose(res.stdout)
    assert "injected crash: rank 1 at epoch 3" in res.stdout
    assert f"resumed from {ckpt} after epoch 2" in res.stdout
    assert epochs_seen(res.stdout) == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert re.search(r"^final test accuracy: \d\.\d\d$", res.stdout, re.M)
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["digits.pt"]  # no temporary file left
    assert not (tmp_path / "runs").exists()


def test_refuses_an_unrelated_checkpoint_file(tmp_path):
    """--checkpoint pointing at someone else's file: exit non-zero naming it, file untouched."""
    precious = tmp_path / "notes.txt"
    precious.write_text("not a checkpoint\n")
    res = subprocess.run(
        [sys.executable, EXAMPLE, f"--checkpoint={precious}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT,
    )
    assert res.returncode != 0
    assert f"--checkpoint {precious}" in res.stderr and "refusing to overwrite" in res.stderr
    assert precious.read_text() == "not a checkpoint\n"
