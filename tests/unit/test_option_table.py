"""The option table is the one home of each option: the command, elaunch.run's parser and docs/cli.md follow it."""

from __future__ import annotations

import dataclasses

import click

from elaunch.cli import main as command
from elaunch.cli.reference import DOC, markdown, rewrite
from elaunch.config import OPTIONS, LaunchConfig, LaunchOptions
from elaunch.config.options import comma_list
from elaunch.run import get_args_parser


def _check_docs() -> bool:
    """The check test_docs makes: docs/cli.md equals what the table generates."""
    text = DOC.read_text()
    return rewrite(text, markdown()) == text


def test_docs_agree_with_the_table():
    assert _check_docs(), "docs/cli.md is stale: run `python -m elaunch.cli.reference`"


def test_the_docs_check_fails_when_a_row_changes(monkeypatch):
    """A planted mismatch: a changed default in the table makes the docs check fail."""
    monkeypatch.setitem(OPTIONS, "hang_timeout", dataclasses.replace(OPTIONS["hang_timeout"], default="5"))
    assert not _check_docs()
    assert "| `PET_HANG_TIMEOUT` | `5` seconds |" in markdown()


def test_the_command_is_derived_from_the_table():
    options = {p.name: p for p in command.params if isinstance(p, click.Option) and p.name in OPTIONS}
    assert list(options) == list(OPTIONS)  # the same options, in the table's order
    for dest, o in OPTIONS.items():
        param = options[dest]
        assert tuple(param.opts) == o.flags and param.envvar == o.envvar and param.help == o.help
        assert param.default == (o.default if o.shown is None else o.shown)


def test_the_argparse_parser_is_derived_from_the_table(monkeypatch):
    for var in [o.envvar for o in OPTIONS.values()]:
        monkeypatch.delenv(var, raising=False)
    actions = {a.dest: a for a in get_args_parser()._actions}
    for dest, o in OPTIONS.items():
        assert tuple(actions[dest].option_strings) == o.flags
        assert actions[dest].default == (comma_list(o.default) if o.argtype is comma_list else o.default)


def test_typed_defaults_come_from_the_table():
    options, config = LaunchOptions(), LaunchConfig()
    for dest in ("hang_timeout", "monitor_interval", "max_restarts", "signals_to_handle", "start_method"):
        assert getattr(options, dest) == getattr(config, dest) == OPTIONS[dest].value()
