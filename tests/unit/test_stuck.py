"""The D-state watch of ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` as tables (pure: states and a clock)."""

from __future__ import annotations

import os

import pytest

from elaunch.agent.stuck import UninterruptibleWatch, proc_state, timeout_from_env


@pytest.mark.parametrize("raw, expected", [
    (None, 0.0), ("", 0.0), ("x", 0.0), ("0", 0.0), ("-3", 0.0), ("nan", 0.0), ("2.5", 2.5), ("60", 60.0),
])
def test_timeout_from_env_as_torch(raw, expected):
    env = {} if raw is None else {"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": raw}
    assert timeout_from_env(env) == expected


def test_a_worker_is_stuck_after_an_unbroken_stretch_in_d():
    now = [0.0]
    states = {100: "D", 200: "S"}
    watch = UninterruptibleWatch(2.0, read_state=states.get, clock=lambda: now[0])
    assert watch.stuck({0: 100, 1: 200}) == {}  # first seen in D at t=0
    now[0] = 1.5
    assert watch.stuck({0: 100, 1: 200}) == {}
    states[100] = "S"  # a break: the stretch starts again
    now[0] = 1.8
    assert watch.stuck({0: 100, 1: 200}) == {}
    states[100] = "D"
    now[0] = 2.0
    assert watch.stuck({0: 100, 1: 200}) == {}
    now[0] = 4.0
    assert watch.stuck({0: 100, 1: 200}) == {0: 2.0}
    states[200] = "D"
    now[0] = 6.5
    assert watch.stuck({0: 100, 1: 200}) == {0: 4.5}  # 200 only since 6.5
    assert watch.stuck({1: 200}) == {}  # 100 exited: forgotten
    assert watch.stuck({0: 100, 1: 200}) == {}  # and a new stretch if it shows again


def test_proc_state_reads_a_real_process():
    assert proc_state(os.getpid()) == "R"  # running: it is reading its own stat
    assert proc_state(2**22 + 7) is None  # no such pid
