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


#: A module that skips as a whole when it is imported, as the modules needing torch or pyetcd do.
MODULE_SKIP = '''
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never_collected():
    pass
'''


def run(tmp_path, ci: bool) -> str:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_skips.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfs", "--continue-on-collection-errors",
                        str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.stdout


def test_under_ci_a_missing_tool_fails_the_test(tmp_path):
    out = run(tmp_path, ci=True)
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out, out
    assert "skipped under CI, where every tool the tests need is installed: etcd is not installed" in out, out
    assert "could not import 'no_such_module_anywhere'" in out, out


def test_outside_ci_a_missing_tool_is_a_skip(tmp_path):
    out = run(tmp_path, ci=False)
    assert "1 passed, 3 skipped, 1 xfailed" in out, out
