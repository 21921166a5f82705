"""Fixtures shared by the integration tests of the example training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES
from tests.helpers import run

EXAMPLE = str(EXAMPLES / "ddp_digits.py")
#: 3 epochs of 23 steps per rank at world size 2
SHORT = ("--epochs", "3")


def final_digest(path: Path) -> str:
    """The SHA-256 of the final parameters that ``--final-params`` wrote to ``path``."""
    return json.loads(path.read_text())["sha256"]


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory) -> str:
    """SHA-256 of the final parameters of an uninterrupted short run (seed 0, world size 2)."""
    tmp = tmp_path_factory.mktemp("reference")
    r = run("elaunch", "--standalone", "--nproc-per-node=2", EXAMPLE, *SHORT,
            "--checkpoint", str(tmp / "ck.pt"), "--final-params", str(tmp / "final.json"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return final_digest(tmp / "final.json")
