"""torchrun's plugin entry points under elaunch, side by side with torchrun.

``tests/plugins/elaunch_test_plugin`` (installed by ``scripts/setup.sh --test``)
registers, as a third-party package would:

* ``torchrun.logs_specs``: ``elaunch-test-flat`` (``<log_dir>/<run_id>/rank<R>.attempt<N>.{out,err,error.json}``);
* ``torchrun.handlers``: ``elaunch-test-c10d``, torch's own c10d dynamic rendezvous under that name.
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

from tests.helpers import ELAUNCH_ADDED_ENV, SCRIPTS, free_port, launcher_env, load_envs, run, start

#: Values that legitimately differ between two launches or launchers.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


@pytest.fixture(scope="module", autouse=True)
def plugin_installed():
    names = {ep.name for ep in entry_points(group="torchrun.handlers")}
    assert "elaunch-test-c10d" in names, (
        "the test plugin is not installed: pip install ./tests/plugins/elaunch_test_plugin "
        "(scripts/setup.sh --test does it)")


def _plugin_rdzv(port: int, run_id: str) -> list[str]:
    return ["--rdzv-backend=elaunch-test-c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]


@pytest.mark.slow
def test_a_torchrun_handlers_backend_runs_two_workers_as_under_torchrun(tmp_path):
    results = {}
    for which in ("torchrun", "elaunch"):
        out = tmp_path / which
        out.mkdir()
        r = run(which, "--nnodes=1", "--nproc-per-node=2", *_plugin_rdzv(free_port(), "plug"),
                str(SCRIPTS / "env_dump.py"), str(out))
        assert r.returncode == 0, r.stderr
        results[which] = load_envs(out)
    assert sorted(results["elaunch"]) == sorted(results["torchrun"]) == ["env_0_0", "env_1_0"]
    for name, theirs in results["torchrun"].items():
        ours = results["elaunch"][name]
        extra, missing = set(ours) - ELAUNCH_ADDED_ENV - set(theirs), set(theirs) - set(ours)
        assert not extra and not missing, f"{name}: extra {extra}, missing {missing}"
        differ = {k for k in theirs if ours[k] != theirs[k]}
        assert differ <= PER_LAUNCH, {k: (ours[k], theirs[k]) for k in differ}
        # the handler's store is the workers' (torch's c10d shares its TCPStore)
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "True" and ours["TORCHELASTIC_RUN_ID"] == "plug"
        assert ours["WORLD_SIZE"] == "2"


@pytest.mark.slow
def test_two_agents_with_different_nproc_meet_through_a_plugin_backend(tmp_path):
    # the adapter shares each node's local world size through the handler's store, as
    # torch's agent does: global ranks count every node's workers (1 + 2 = 3)
    port = free_port()
    agents = [start("elaunch", "--nnodes=2", f"--nproc-per-node={n}", *_plugin_rdzv(port, "hetero"),
                    str(SCRIPTS / "env_dump.py"), str(tmp_path)) for n in (1, 2)]
    try:
        outs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], [err for _, err in outs]
    envs = load_envs(tmp_path)
    assert sorted(envs) == ["env_0_0", "env_1_0", "env_2_0"]
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"3"}
    by_group = sorted((e["GROUP_RANK"], e["LOCAL_RANK"], e["RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs.values())
    # the node with group rank g holds ranks after those of the nodes before it
    firsts = {g: int(r) - int(lr) for g, lr, r, _ in by_group}
    sizes = {g: int(lws) for g, _, _, lws in by_group}
    assert sorted(sizes.values()) == [1, 2]
    assert firsts == {"0": 0, "1": sizes["0"]}


def _flat_files(log_dir):
    return sorted(str(p.relative_to(log_dir)).split("/", 1)[1] for p in log_dir.glob("*/*") if p.is_file())


@pytest.mark.slow
def test_a_torchrun_logs_specs_names_the_files_as_under_torchrun(tmp_path):
    files = {}
    for which in ("torchrun", "elaunch"):
        out, logs = tmp_path / f"{which}_out", tmp_path / f"{which}_logs"
        out.mkdir()
        r = run(which, "--standalone", "--nproc-per-node=2", "--logs-specs=elaunch-test-flat",
                f"--log-dir={logs}", "--tee=1", str(SCRIPTS / "say.py"), str(out))
        assert r.returncode == 0, r.stderr
        files[which] = _flat_files(logs)
        run_dir = next(logs.iterdir())
        for rank in (0, 1):
            assert (run_dir / f"rank{rank}.attempt0.out").read_text() == f"out {rank}\n"
            assert (run_dir / f"rank{rank}.attempt0.err").read_text() == f"err {rank}\n"
            env = load_envs(out)[f"env_{rank}_0"]
            assert env["TORCHELASTIC_ERROR_FILE"] == str(run_dir / f"rank{rank}.attempt0.error.json")
            assert run_dir.name == env["TORCHELASTIC_RUN_ID"]
            # --tee=1: stdout is followed on the console, with torchrun's prefix; stderr only in its file
            assert f"[default{rank}]:out {rank}" in r.stdout
            assert f"err {rank}" not in r.stderr
    assert files["elaunch"] == files["torchrun"] == [
        "rank0.attempt0.err", "rank0.attempt0.out", "rank1.attempt0.err", "rank1.attempt0.out"]


@pytest.mark.slow
def test_a_failure_is_read_from_the_error_file_a_logs_specs_names(tmp_path):
    logs = tmp_path / "logs"
    r = run("elaunch", "--standalone", "--nproc-per-node=1", "--logs-specs=elaunch-test-flat", f"--log-dir={logs}",
            str(SCRIPTS / "err_record.py"), "torch", "raise")
    assert r.returncode == 1
    error_file = next(logs.glob("*/rank0.attempt0.error.json"))
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: boom 42"
    assert f"error_file: {error_file}" in r.stderr and "ValueError: boom 42" in r.stderr


@pytest.mark.parametrize("api", ["torch.distributed.run", "elaunch.run"])
def test_an_unknown_logs_specs_name_is_a_value_error_from_main(api, tmp_path):
    import importlib

    main = importlib.import_module(api).main
    with pytest.raises(ValueError, match="nope"):
        main(["--standalone", "--logs-specs=nope", str(SCRIPTS / "env_dump.py"), str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing ran


def test_the_elaunch_command_rejects_an_unknown_logs_specs_name_in_one_line(tmp_path):
    r = run("elaunch", "--standalone", "--logs-specs=nope", str(SCRIPTS / "env_dump.py"), str(tmp_path),
            env=launcher_env())
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "elaunch: error: --logs-specs=nope: no 'torchrun.logs_specs' entry point of that name "
        "(installed: default, elaunch-test-broken, elaunch-test-flat)"]
