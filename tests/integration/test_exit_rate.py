"""PyTorch's ``test_init_method_env_with_torchelastic`` under elaunch and torchrun, interleaved (issue 22, item 2).

The case: ``--nnodes=1 --nproc-per-node=4 --master-addr=localhost --master-port=P``
of a gloo script that all-reduces, prints ``Done`` and exits without
``destroy_process_group()`` (``tests/scripts/init_method_env.py``). Such a worker
sometimes dies of SIGABRT after its last line, under any launcher and with none:
gloo's work thread releases the all-reduced tensor (which takes the GIL) after the
interpreter began to finalize. How often follows the CPU contention of those few
milliseconds, so it swings with the machine's load (docs/migrating-from-torchrun.md).

What is asserted:

- every clean run of either launcher got through the script (four ``Done``), and
  every run that failed failed of that race (a ``Done``, then "terminate called
  without an active exception"): elaunch adds no failure of its own;
- elaunch's failure report of such a run names the cause and the cure;
- elaunch's clean-exit rate is not below torchrun's. The runs alternate, in random
  order within each pair, so both launchers see the same load. A rate cannot be
  pinned by a few runs: the check is Fisher's exact test, one-sided, and fails
  when elaunch's failures are more than torchrun's beyond what chance gives once
  in :data:`ALPHA`'s inverse. With :data:`PAIRS` pairs it catches an elaunch that
  fails every run while torchrun fails up to 7 of its 16. The runs stop as soon as the
  pairs left cannot change that verdict (:func:`decided`): about half of them, typically.
"""

from __future__ import annotations

import random
import subprocess
import sys
from math import comb

import pytest

from elaunch.errors.summary import EXIT_ABORT_HINT, EXIT_ABORT_LINE as ABORT_LINE
from tests.helpers import SCRIPTS, free_port, kill_tree, launcher_env, run

pytestmark = pytest.mark.slow

#: Runs per launcher (about 4 s each on 2 cores: four workers import torch).
PAIRS = 16
#: The test fails when elaunch's excess of failures would happen by chance less often than this.
ALPHA = 0.001
NPROC = 4


def fisher_one_sided(a_failed: int, b_failed: int, n: int) -> float:
    """P(launcher A fails at least ``a_failed`` of its ``n`` runs) when both fail at one rate.

    Fisher's exact test on the 2x2 table (failed, clean) x (A, B), both with ``n``
    runs: the hypergeometric tail of A's share of the ``a_failed + b_failed`` failures.
    """
    failed = a_failed + b_failed
    top = sum(comb(failed, x) * comb(2 * n - failed, n - x) for x in range(a_failed, min(n, failed) + 1))
    return top / comb(2 * n, n)


def test_fisher_one_sided_tail():
    assert fisher_one_sided(0, 0, 16) == 1.0
    assert fisher_one_sided(5, 5, 10) > 0.5  # equal counts: no evidence
    assert fisher_one_sided(16, 6, 16) < ALPHA  # always failing against 6 of 16
    assert fisher_one_sided(16, 7, 16) < ALPHA
    assert fisher_one_sided(16, 8, 16) > ALPHA  # the test's limit: torchrun failing half
    assert fisher_one_sided(10, 6, 16) > 0.1  # a few more failures: chance


def _once(which: str) -> bool:
    """Whether one run of the case under ``which`` exited clean."""
    r = run(which, "--nnodes=1", f"--nproc-per-node={NPROC}", "--master-addr=localhost",
            f"--master-port={free_port()}", str(SCRIPTS / "init_method_env.py"), timeout=120)
    out = r.stdout + r.stderr
    if r.returncode == 0:
        assert r.stdout.count("Done") == NPROC, f"{which}: not every worker got through the script:\n{out[-3000:]}"
    else:  # the aborted worker printed its line; the launcher may have stopped a slower one before its own
        assert "Done" in r.stdout and ABORT_LINE in out, f"{which} failed, and not of gloo's exit race:\n{out[-3000:]}"
    if r.returncode != 0 and which == "elaunch":
        assert "(SIGABRT)" in out and EXIT_ABORT_HINT in out, out[-3000:]
    return r.returncode == 0


def _once_api(which: str) -> bool:
    """Whether one run of PyTorch's exact case exited clean: ``main([...])`` with ``--run-path`` (issue 35).

    ``test_init_method_env_with_torchelastic``'s argv, through the launcher's Python API
    (``tests/scripts/launch_main.py``). With ``--run-path`` torch's workers are function
    workers: one that returned waits until every worker returned, and so do elaunch's.
    """
    argv = ["--run-path", "--nnodes=1", f"--nproc-per-node={NPROC}", "--master-addr=localhost",
            f"--master-port={free_port()}", "--monitor-interval=1", str(SCRIPTS / "init_method_env.py"),
            "--init-method=env://"]
    code, stdout, stderr = _api_run(which, argv)
    out = stdout + stderr
    if code == 0:
        assert stdout.count("Done") == NPROC, f"{which}: not every worker got through the script:\n{out[-3000:]}"
    else:
        assert "Done" in stdout and ABORT_LINE in out, f"{which} failed, and not of gloo's exit race:\n{out[-3000:]}"
    return code == 0


def _api_run(which: str, argv: list[str]) -> tuple[int, str, str]:
    """``launch_main.py which argv``: (status, stdout, stderr); its tree killed at the 120 s deadline."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "launch_main.py"), which, *argv], env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise AssertionError(f"{which} main({argv}) timed out after 120 s") from None
    return proc.returncode, stdout, stderr


def decided(e_failed: int, t_failed: int, pairs_run: int, pairs: int = PAIRS) -> bool:
    """Whether the remaining pairs can no longer change the verdict of all ``pairs``.

    The tail is monotone: more failures of elaunch, or fewer of torchrun, only lower
    it. So when even the worst case (every remaining elaunch run failing, every
    remaining torchrun run clean) keeps it at or above :data:`ALPHA`, the test passes
    whatever comes; when even the best case is below, it fails whatever comes.
    """
    left = pairs - pairs_run
    worst = fisher_one_sided(e_failed + left, t_failed, pairs)
    best = fisher_one_sided(e_failed, t_failed + left, pairs)
    return worst >= ALPHA or best < ALPHA


def test_stopping_early_never_changes_the_verdict():
    for k in range(PAIRS + 1):  # after k pairs with e_k and t_k failures, decided: every way on agrees with it
        for e_k in range(k + 1):
            for t_k in range(k + 1):
                if not decided(e_k, t_k, k):
                    continue
                early = fisher_one_sided(e_k + PAIRS - k, t_k, PAIRS) >= ALPHA  # what the test asserts then
                left = PAIRS - k
                assert all((fisher_one_sided(e, t, PAIRS) >= ALPHA) == early
                           for e in range(e_k, e_k + left + 1) for t in range(t_k, t_k + left + 1)), (k, e_k, t_k)
    assert not decided(0, 0, 0) and decided(1, 3, 6) and decided(14, 0, 14)  # pass early; fail early
    assert decided(3, 3, PAIRS)  # all pairs run: always decided


# both variants run in the long part: the suite and the other parts each stay under 20 minutes
@pytest.mark.long
@pytest.mark.parametrize("once", [_once, _once_api], ids=["cli", "api-run-path"])
def test_elaunch_exits_clean_at_least_as_often_as_torchrun(once):
    failed = {"elaunch": 0, "torchrun": 0}
    runs = 0
    while runs < PAIRS and not decided(failed["elaunch"], failed["torchrun"], runs):
        pair = ["elaunch", "torchrun"]
        random.shuffle(pair)
        for which in pair:
            failed[which] += not once(which)
        runs += 1
    p_worst = fisher_one_sided(failed["elaunch"] + PAIRS - runs, failed["torchrun"], PAIRS)
    assert p_worst >= ALPHA, (
        f"elaunch failed {failed['elaunch']} of {runs} runs, torchrun {failed['torchrun']} of {runs}: "
        f"one-sided Fisher p over {PAIRS} pairs < {ALPHA} whatever the {PAIRS - runs} pairs not run")
