"""The documentation: the generated option tables are current and the site builds with --strict."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elaunch.cli.reference import DOC, markdown, rewrite

REPO = Path(__file__).resolve().parents[2]


def test_cli_md_option_tables_are_generated_from_the_command():
    text = DOC.read_text()
    assert rewrite(text, markdown()) == text, "docs/cli.md is stale: run `python -m elaunch.cli.reference`"


def test_every_option_of_the_command_is_in_the_reference():
    from elaunch.cli import main

    table = markdown()
    import click

    for param in main.params:
        if not isinstance(param, click.Option):
            continue  # SCRIPT and its ARGS
        for spelling in param.opts:
            assert f"`{spelling}" in table, spelling


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (scripts/setup.sh --test installs it)")
def test_the_docs_site_builds_strictly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
