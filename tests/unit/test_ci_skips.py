"""Under CI a test skipped for a missing tool fails; a case marked not applicable stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

TESTS = '''
import pytest
from tests.conftest import NOT_APPLICABLE

def test_needs_a_tool():
    pytest.skip("etcd is not installed")

def test_does_not_apply():
    pytest.skip(f"{NOT_APPLICABLE} only etcd-v3 speaks gRPC")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

def test_passes():
    pass
'''


def run(tmp_path, ci: bool) -> str:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_skips.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfs", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.stdout


def test_under_ci_a_missing_tool_fails_the_test(tmp_path):
    out = run(tmp_path, ci=True)
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed" in out, out
    assert "skipped under CI, where every tool the tests need is installed: etcd is not installed" in out, out


def test_outside_ci_a_missing_tool_is_a_skip(tmp_path):
    out = run(tmp_path, ci=False)
    assert "1 passed, 2 skipped, 1 xfailed" in out, out
