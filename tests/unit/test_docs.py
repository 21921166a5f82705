"""The documentation: the generated option tables are current and the site builds with --strict."""

from __future__ import annotations

import importlib.util
import os
import shutil
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


needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason="mkdocs is not installed (scripts/setup.sh --test installs it)")


def build_site(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the site whose mkdocs.yml is in ``root``.

    Never with ``-q``: mkdocs 1.6 drops the warnings that -q hides before strict mode
    counts them, so a quiet strict build passes with broken links.
    """
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@needs_mkdocs
def test_the_docs_site_builds_strictly(tmp_path):
    r = build_site(REPO, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WARNING" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


@needs_mkdocs
@pytest.mark.parametrize("link,needle", [
    ("[the script](../examples/slurm/train.sbatch)", "../examples/slurm/train.sbatch"),
    ("[stacks](status.md#no-such-heading)", "#no-such-heading"),
    ("[gone](no-such-page.md)", "no-such-page.md"),
])
def test_the_strict_build_fails_on_a_planted_broken_link(tmp_path, link, needle):
    """The check above can fail: a copy of the docs with one broken link does not build."""
    root = tmp_path / "copy"
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    page = root / "docs" / "usage.md"
    page.write_text(page.read_text() + f"\nSee {link}.\n")
    r = build_site(root, tmp_path / "site")
    assert r.returncode != 0, r.stderr[-3000:]
    assert needle in r.stderr, r.stderr[-3000:]
