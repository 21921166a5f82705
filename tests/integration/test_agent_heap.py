"""The ``elaunch`` command's agent freezes its start-up heap; the Python API leaves the caller's alone."""

from __future__ import annotations

import gc
import pytest

from elaunch.launch import launch
from elaunch.procs.spawn import stop_being_subreaper
from elaunch.run import config_from_args, parse_args, run


@pytest.fixture
def unfrozen():
    """Start and end with nothing frozen (a frozen pytest heap would outlive the test), and, as the
    command's process would have exited, not a child subreaper (the command's launch leaves the flag)."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    stop_being_subreaper()


def _args(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    return parse_args(["--standalone", "--nproc-per-node=1", "--monitor-interval=0.05",
                       f"--log-dir={tmp_path / 'logs'}", str(script)])


def test_the_command_freezes_the_agents_start_up_heap(unfrozen, tmp_path):
    config, _, _ = config_from_args(_args(tmp_path))
    assert launch(config) == 0
    # every object alive at start-up (this test's modules among them) is frozen
    assert gc.get_freeze_count() > 10_000


def test_the_python_api_does_not_freeze_the_callers_heap(unfrozen, tmp_path):
    run(_args(tmp_path))
    assert gc.get_freeze_count() == 0
