"""elaunch.progress() (worker side) and ProgressFiles / ProgressWatch (agent side).

progress() keeps its mode in module state settled by the first call, so each case
runs it in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from elaunch.procs.progress_files import (
    FILE_BYTES,
    PROGRESS_FILE_ENV,
    STACKS_FILE_ENV,
    STACKS_SIGNAL,
    STACKS_SIGNAL_ENV,
    ProgressFiles,
    ProgressWatch,
    RankProgress,
)


def _python(code: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELAUNCH_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env}, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def files(tmp_path):
    with ProgressFiles(range(2), base_dir=str(tmp_path)) as f:
        yield f


def test_counter_counts_every_call(files):
    out = _python("import elaunch\nfor _ in range(1000): elaunch.progress()\n", files.env(1))
    assert out.returncode == 0, out.stderr
    assert files.read() == {0: 0, 1: 1000}
    assert out.stderr == ""


def test_without_env_is_a_noop_and_import_is_light():
    out = _python(
        """
        import sys
        import elaunch
        assert "elaunch._worker_progress" not in sys.modules, "import elaunch loaded _progress eagerly"
        from elaunch import progress
        for _ in range(1000):
            progress()
        import elaunch._worker_progress as p
        assert p._counter is None and p._initialised
        assert "torch" not in sys.modules and "mmap" not in sys.modules and "faulthandler" not in sys.modules
        print("ok")
        """,
        {},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_registers_stack_handler_and_names_its_pid(files):
    out = _python(
        """
        import os, signal, elaunch
        elaunch.progress()
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), int(os.environ["ELAUNCH_STACKS_SIGNAL"]))  # handled, not fatal
        """,
        files.env(0),
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    text = open(files.stacks_file(0)).read()
    assert text.splitlines()[0] == f"elaunch-stacks pid={pid} signal={STACKS_SIGNAL}"
    assert 'File "<string>"' in text  # faulthandler's dump of the main thread


@pytest.mark.parametrize(
    "content, expected",
    [(b"\0" * 12, "is 12 bytes, needs at least 56"), (None, "No such file")],
    ids=["too-short", "missing"],
)
def test_unusable_file_warns_once_and_never_raises(tmp_path, content, expected):
    path = tmp_path / "progress"
    if content is not None:
        path.write_bytes(content)
    out = _python(
        "import elaunch\nfor _ in range(10): elaunch.progress()\nprint('ok')\n",
        {PROGRESS_FILE_ENV: str(path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert out.stderr.count("RuntimeWarning") == 1 and expected in out.stderr


def test_bad_signal_disables_only_stack_dumps(files):
    env = {**files.env(0), STACKS_SIGNAL_ENV: "not-a-number"}
    out = _python("import elaunch\nfor _ in range(5): elaunch.progress()\n", env)
    assert out.returncode == 0, out.stderr
    assert "stack dumps disabled" in out.stderr
    assert files.read()[0] == 5


def test_forked_child_counts_into_the_same_file(files):
    out = _python(
        """
        import os, elaunch
        elaunch.progress()
        pid = os.fork()
        if pid == 0:
            for _ in range(10): elaunch.progress()
            os._exit(0)
        os.waitpid(pid, 0)
        """,
        files.env(0),
    )
    assert out.returncode == 0, out.stderr
    assert files.read()[0] == 11


def test_exit_mark_is_the_pid_of_the_exiting_worker_only(files):
    out = _python(
        """
        import os, sys, elaunch
        elaunch.progress()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a forked child runs the inherited atexit handlers: it must not mark
        os.waitpid(pid, 0)
        print(os.getpid(), flush=True)
        raise SystemExit(3)  # an exit with any status marks
        """,
        files.env(1),
    )
    assert out.returncode == 3, out.stderr
    assert files.exit_marks() == {1: int(out.stdout)}
    assert files.read() == {0: 0, 1: 1}


def test_no_exit_mark_while_running_nor_without_a_progress_call(files):
    out = _python(
        """
        import os, sys, elaunch
        elaunch.progress()
        with open(os.environ["ELAUNCH_PROGRESS_FILE"], "rb") as f:
            print(int.from_bytes(f.read(16)[8:], sys.byteorder))  # no mark while the program runs
        """,
        files.env(0),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert _python("import elaunch\n", files.env(1)).returncode == 0  # never called progress()
    assert list(files.exit_marks()) == [0]  # rank 0 exited after its progress() call
    files.reset()
    assert files.exit_marks() == {}


def test_progress_files_layout_env_reset_and_close(tmp_path):
    pf = ProgressFiles([3, 1], base_dir=str(tmp_path))
    directory = pf.directory
    assert os.path.dirname(directory) == str(tmp_path)
    assert oct(os.stat(directory).st_mode & 0o777) == oct(0o700)
    assert pf.local_ranks == [1, 3]
    assert os.path.getsize(pf.progress_file(3)) == FILE_BYTES
    assert pf.env(1) == {
        PROGRESS_FILE_ENV: pf.progress_file(1),
        STACKS_FILE_ENV: pf.stacks_file(1),
        STACKS_SIGNAL_ENV: str(STACKS_SIGNAL),
    }
    assert pf.stacks_files() == {1: pf.stacks_file(1), 3: pf.stacks_file(3)}
    with pytest.raises(KeyError, match="local rank 2"):
        pf.env(2)
    with open(pf.progress_file(3), "r+b") as f:
        f.write((7).to_bytes(8, sys.byteorder))
    with open(pf.stacks_file(3), "w") as f:
        f.write("old dump")
    assert pf.read() == {1: 0, 3: 7}
    pf.reset()
    assert pf.read() == {1: 0, 3: 0}
    assert os.path.getsize(pf.stacks_file(3)) == 0
    pf.close()
    assert not os.path.exists(directory)
    assert pf.read() == {}
    pf.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        pf.env(1)


def test_default_directory_prefers_dev_shm():
    with ProgressFiles([0]) as pf:
        usable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
        assert pf.directory.startswith("/dev/shm/") == usable
        assert os.path.basename(pf.directory).startswith("elaunch-progress-")


def test_stacks_signal_is_a_free_realtime_signal():
    import signal

    assert signal.SIGRTMIN < STACKS_SIGNAL <= signal.SIGRTMAX
    assert signal.getsignal(STACKS_SIGNAL) == signal.SIG_DFL


# ProgressWatch: a list of (counters, now) updates -> the table after the last one.
WATCH_CASES = {
    "first sight starts the clock": (
        [({0: 0, 1: 0}, 10.0)],
        {0: RankProgress(False, 0.0, 0), 1: RankProgress(False, 0.0, 0)},
    ),
    "never reported, clock from first sight": (
        [({0: 0}, 10.0), ({0: 0}, 25.0)],
        {0: RankProgress(False, 15.0, 0)},
    ),
    "reported and still moving": (
        [({0: 0}, 10.0), ({0: 5}, 12.0), ({0: 9}, 13.0)],
        {0: RankProgress(True, 0.0, 9)},
    ),
    "reported then stuck": (
        [({0: 0}, 10.0), ({0: 5}, 12.0), ({0: 5}, 20.0), ({0: 5}, 30.5)],
        {0: RankProgress(True, 18.5, 5)},
    ),
    "already counting when first seen": (
        [({0: 3}, 10.0), ({0: 3}, 11.0)],
        {0: RankProgress(True, 1.0, 3)},
    ),
    "one rank stuck, one moving": (
        [({0: 1, 1: 1}, 0.0), ({0: 1, 1: 2}, 5.0), ({0: 1, 1: 3}, 9.0)],
        {0: RankProgress(True, 9.0, 1), 1: RankProgress(True, 0.0, 3)},
    ),
    "counter going down (files reset) is a change; ever_reported sticks": (
        [({0: 4}, 1.0), ({0: 0}, 2.0), ({0: 0}, 6.0)],
        {0: RankProgress(True, 4.0, 0)},
    ),
    "rank missing from an update is dropped; back again starts afresh": (
        [({0: 4, 1: 2}, 1.0), ({0: 4}, 2.0), ({0: 4, 1: 0}, 3.0), ({0: 4, 1: 0}, 7.0)],
        {0: RankProgress(True, 6.0, 4), 1: RankProgress(False, 4.0, 0)},
    ),
}


@pytest.mark.parametrize("updates, expected", WATCH_CASES.values(), ids=WATCH_CASES.keys())
def test_progress_watch(updates, expected):
    watch = ProgressWatch()
    assert watch.table() == {}
    for counters, now in updates:
        table = watch.update(counters, now)
    assert table == expected
    assert watch.table() == expected


def test_progress_watch_rejects_time_going_back_and_resets():
    watch = ProgressWatch()
    watch.update({0: 1}, 5.0)
    with pytest.raises(ValueError, match=r"now \(4.0\) is earlier than the previous update \(5.0\)"):
        watch.update({0: 1}, 4.0)
    watch.reset()
    assert watch.table() == {}
    assert watch.update({0: 0}, 1.0) == {0: RankProgress(False, 0.0, 0)}


def test_step_is_stored_with_the_first_call_time(files):
    import time

    before = time.time()
    out = _python(
        """
        import elaunch
        elaunch.progress(step=7)
        for s in range(8, 20): elaunch.progress(step=s)
        elaunch.progress()  # without a step: the last step stays
        """,
        files.env(0),
    )
    assert out.returncode == 0, out.stderr
    assert files.read() == {0: 14, 1: 0}
    assert files.steps() == {0: 19, 1: None}
    first = files.first_calls()
    assert list(first) == [0] and before - 1 <= first[0] <= time.time()
    files.reset()
    assert files.steps() == {0: None, 1: None} and files.first_calls() == {}


def test_stamp_answers_the_agents_request_with_the_next_calls_step_and_time(files):
    """A call stamps (step, time in ns) only when the agent asked: the straggler watch's input."""
    import time

    script = """
        import sys, time, elaunch
        elaunch.progress(step=3)
        print("ready", flush=True)
        sys.stdin.readline()  # the agent asks now
        time.sleep(0.2)
        print(time.time_ns(), flush=True)
        elaunch.progress(step=4)
        elaunch.progress(step=5)  # a second call does not restamp
        sys.stdin.readline()
        for _ in range(3): elaunch.progress()  # no step given: the last step given is stamped
        """
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELAUNCH_")}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env={**base, **files.env(0)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert files.stamps() == {}  # never asked
        files.ask_stamps()
        assert files.stamps() == {}  # asked, not yet answered
        proc.stdin.write("\n")
        proc.stdin.flush()
        before = int(proc.stdout.readline())
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    stamps = files.stamps()
    assert list(stamps) == [0] and stamps[0][0] == 4
    assert before <= stamps[0][1] <= before + 0.1e9 and stamps[0][1] <= time.time_ns()
    files.ask_stamps()
    assert files.stamps() == {}  # rank 0 exited: its request stays pending
    out = _python("import elaunch\nfor _ in range(5): elaunch.progress()\n", files.env(1))
    assert out.returncode == 0, out.stderr
    assert files.stamps() == {1: (1, files.stamps()[1][1])}  # the first call answered it: the counter was 1
    files.reset()
    assert files.stamps() == {}


def test_step_zero_is_a_step(files):
    out = _python("import elaunch\nelaunch.progress(step=0)\n", files.env(0))
    assert out.returncode == 0, out.stderr
    assert files.steps()[0] == 0


@pytest.mark.parametrize("bad, error", [(-1, "ValueError"), (2.5, "TypeError"), ("3", "TypeError"),
                                        (2**64, "ValueError")])
def test_bad_step_raises_one_clear_error_and_later_calls_still_count(files, bad, error):
    out = _python(
        f"""
        import elaunch
        for first in (True, False):
            try:
                elaunch.progress(step={bad!r})
            except Exception as exc:
                print(type(exc).__name__, exc)
        elaunch.progress(step=3)
        """,
        files.env(0),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [f"{error} elaunch.progress(step={bad!r}): step must be an integer from 0 to 2**64 - 2"] * 2
    assert files.read()[0] == 3 and files.steps()[0] == 3  # the bad first call set the file up and counted


def test_progress_watch_keeps_the_last_step_reported():
    watch = ProgressWatch()
    watch.update({0: 1, 1: 0}, 1.0, {0: 5, 1: None})
    assert watch.update({0: 2, 1: 0}, 2.0) == {0: RankProgress(True, 0.0, 2, 5), 1: RankProgress(False, 1.0, 0)}
    assert watch.update({0: 3}, 3.0, {0: 6})[0].step == 6
    watch.reset()
    assert watch.update({0: 0}, 4.0, {0: None}) == {0: RankProgress(False, 0.0, 0, None)}
