"""The job secret (``config.secret``): from the environment or a file, checked, never shown."""

from __future__ import annotations

import pytest

from elaunch.config import ConfigError
from elaunch.config.launch_config import LaunchConfig
from elaunch.config.secret import job_secret


def test_no_variable_no_secret():
    assert job_secret({}) is None


def test_the_variable_is_the_secret():
    assert job_secret({"ELAUNCH_JOB_SECRET": "s" * 16}) == b"s" * 16


def test_a_file_holds_it_and_one_trailing_newline_is_dropped(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef\n")
    assert job_secret({"ELAUNCH_JOB_SECRET_FILE": str(path)}) == b"0123456789abcdef"
    path.write_bytes(b"0123456789abcdef\n\n")
    assert job_secret({"ELAUNCH_JOB_SECRET_FILE": str(path)}) == b"0123456789abcdef\n"


@pytest.mark.parametrize("environ, message", [
    ({"ELAUNCH_JOB_SECRET": "short"}, "ELAUNCH_JOB_SECRET: the secret is 5 bytes; at least 16"),
    ({"ELAUNCH_JOB_SECRET": ""}, "ELAUNCH_JOB_SECRET: the secret is 0 bytes"),
    ({"ELAUNCH_JOB_SECRET_FILE": "/nonexistent"}, "ELAUNCH_JOB_SECRET_FILE=/nonexistent: cannot read it"),
    ({"ELAUNCH_JOB_SECRET": "s" * 16, "ELAUNCH_JOB_SECRET_FILE": "/x"}, "both set"),
])
def test_bad_secrets_are_config_errors_that_never_show_the_secret(environ, message):
    with pytest.raises(ConfigError, match=message) as err:
        job_secret(environ)
    assert "short" not in str(err.value) and "s" * 16 not in str(err.value)


def test_the_launch_config_never_shows_the_secret():
    assert "hunter2" not in repr(LaunchConfig(job_secret=b"hunter2" * 4))
