"""Nobody outside the job gets in: the replica service against a real attacker process.

The attacker (tests/scripts/replica_attacker.py) is a separate process that knows the
wire format (it imports ``replica_wire``) but not the key. Against a real service (its
real child, real TCP on loopback) it gets nothing with no handshake, a wrong key or a
replayed answer; its forged snapshot never lands; its idle connections are closed, and
a flood of them neither grows the child's threads without bound nor keeps the job's
own peers out. Connections from addresses that are not members of the round are
closed unread. A client never sends to a server that cannot prove the key.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading

import psutil
import pytest

from elaunch.checkpoint import slotfile
from elaunch.checkpoint import replica_wire as wire
from elaunch.checkpoint._replica_child import MAX_PEERS, MAX_PENDING, is_member, member_ips
from elaunch.checkpoint.replicas import ReplicaService, fetch
from tests.conftest import wait_for
from tests.helpers import SCRIPTS
from tests.slots import KEY, node, shm, write_slot  # noqa: F401 - fixtures; KEY: the attacker does not hold it

WRONG = b"w" * 32
DEADLINE = 20.0  #: seconds a copy may take to appear (the machine is shared and noisy)
ATTACKER = str(SCRIPTS / "replica_attacker.py")


class Boom:
    """A state object whose unpickling would run a command (touch a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def attack(port: int, *args: str, timeout: float = 60) -> dict:
    """Run the attacker process against 127.0.0.1:``port``; its JSON verdict."""
    out = subprocess.run([sys.executable, ATTACKER, "127.0.0.1", str(port), *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


class _Recorder:
    """A socket stand-in for ``authenticate_server``: forwards what is sent, keeps a copy."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent = sock, b""

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)


def recorded_answer(port: int) -> str:
    """The answer line a member holding the key sent in one real handshake (what a sniffer could record)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, sock.makefile("rb") as rfile:
        rec = _Recorder(sock)
        wire.authenticate_server(rec, rfile, KEY)
        return rec.sent.decode().strip()


def test_nothing_is_served_without_the_key_nor_with_a_wrong_or_replayed_answer(node):
    a_dir, a = node("a")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 3, os.urandom(1 << 20), replicated=True)
    assert attack(a.port, "get", "0", "3", KEY.hex())["served"] > (1 << 20)  # the probe works with the key
    for how in ("-", WRONG.hex()):
        assert attack(a.port, "get", "0", "3", how) == {"served": 0, "closed": True}, how
    assert attack(a.port, "replay", recorded_answer(a.port), "0", "3") == {"served": 0, "closed": True}
    stats = a.stats()
    assert stats["served"] == 1 and stats["unauthenticated"] == 3


def test_a_forged_snapshot_put_without_the_key_never_lands_and_runs_nothing(node, shm):
    b_dir, b = node("b")
    marker = os.path.join(shm, "pwned")
    forged = os.path.join(shm, "forged")
    write_slot(forged, 10**9, b"", meta=pickle.dumps({"x": Boom(marker)}), world_size=2, replicated=True)
    for how in ("-", WRONG.hex()):
        verdict = attack(b.port, "put", forged, str(10**9), how)
        assert verdict["closed"] and not verdict.get("answered"), verdict
    assert os.listdir(os.path.join(b_dir, "replicas")) == [] and not os.path.exists(marker)
    assert b.stats()["received"] == 0 and b.stats()["unauthenticated"] == 2


def test_an_idle_connection_that_never_authenticates_is_closed(node):
    _a_dir, a = node("a")
    assert attack(a.port, "flood", "1", str(wire.AUTH_TIMEOUT + 10)) == {"opened": 1, "closed": 1}


def _child_threads(service: ReplicaService) -> int:
    return psutil.Process(service.pid).num_threads()


def test_a_flood_of_idle_connections_is_bounded_and_the_jobs_peers_still_get_through(node, shm):
    a_dir, a = node("a")
    b_dir, b = node("b")
    a.set_ring([("127.0.0.1", b.port, KEY)])
    slot0, slot1 = slotfile.slot_paths(a_dir, 0)
    write_slot(slot0, 1, os.urandom(1 << 16))
    wait_for(lambda: slotfile.read_info(os.path.join(b_dir, "replicas", "r0")), DEADLINE, what="the first copy")
    result: list[dict] = []
    flood = threading.Thread(target=lambda: result.append(attack(b.port, "flood", "300", "12")))
    flood.start()
    try:
        wait_for(lambda: b.stats()["evicted"] > 0, DEADLINE, what="the flood to fill the pending connections")
        most = MAX_PENDING + MAX_PEERS + 8  # accept, prune, the main thread and a few ending their reads
        assert _child_threads(b) <= most
        write_slot(slot1, 2, os.urandom(1 << 16))  # the ring's open connection
        wait_for(lambda: (slotfile.read_info(os.path.join(b_dir, "replicas", "r0")) or slotfile.read_info(
            slot0)).step == 2, DEADLINE, what="step 2's copy during the flood")
        dest = os.path.join(shm, "fetched")
        assert fetch("127.0.0.1", b.port, 0, 2, dest, timeout=10, key=KEY)  # a new connection, mid-flood
        assert _child_threads(b) <= most
    finally:
        flood.join(60)
    assert result and result[0]["opened"] == 300 and result[0]["closed"] == 300  # evicted or timed out


def test_connections_from_addresses_outside_the_round_are_closed_unread(node, shm):
    a_dir, a = node("a")
    write_slot(slotfile.slot_paths(a_dir, 0)[0], 3, os.urandom(1 << 10), replicated=True)
    dest = os.path.join(shm, "fetched")
    a.set_members(["192.0.2.1"])  # TEST-NET-1: a member that is not this host; applied when it returns
    assert not fetch("127.0.0.1", a.port, 0, 3, dest, timeout=10, key=KEY)
    assert attack(a.port, "get", "0", "3", KEY.hex()) == {"served": 0, "closed": True}
    assert a.stats()["strangers"] >= 2 and a.stats()["unauthenticated"] == 0
    a.set_members(["localhost", "192.0.2.1"])
    assert fetch("127.0.0.1", a.port, 0, 3, dest, timeout=10, key=KEY)


def test_a_client_never_talks_to_a_server_that_cannot_prove_the_key():
    """An impostor on a member's port answers the challenge with a made-up proof: nothing is sent to it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        got = []

        def impostor() -> None:
            conn, _ = listener.accept()
            with conn, conn.makefile("rb") as rfile:
                wire.send_json(conn, {"auth": "hmac-sha256", "nonce": os.urandom(32).hex()})
                got.append(wire.read_json(rfile))
                wire.send_json(conn, {"mac": os.urandom(32).hex()})
                conn.settimeout(5)
                got.append(conn.recv(4096))  # anything the client sends after the proof

        server = threading.Thread(target=impostor)
        server.start()
        with pytest.raises(wire.AuthError):
            wire.connect(listener.getsockname(), KEY, 5)
        server.join(10)
    assert set(got[0]) == {"nonce", "mac"} and got[1] == b""  # it answered the challenge, then sent nothing


def test_the_two_sides_of_one_key_authenticate_each_other_over_a_socket_pair():
    a, b = socket.socketpair()
    errors = []

    def server() -> None:
        try:
            with b.makefile("rb") as rfile:
                wire.authenticate_client(b, rfile, KEY)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=server)
    thread.start()
    with a, b, a.makefile("rb", buffering=0) as rfile:
        wire.authenticate_server(a, rfile, KEY)
        thread.join(10)
    assert errors == []


@pytest.mark.parametrize("ip, hosts, member", [
    ("127.0.0.1", None, True),  # no member list: anyone (still authenticated)
    ("127.0.0.1", [], False),
    ("127.0.0.1", ["127.0.0.1"], True),
    ("127.0.0.5", ["localhost"], True),  # one member is loopback: every loopback address is
    ("::ffff:127.0.0.1", ["127.0.0.1"], True),  # an IPv4-mapped address on a dual-stack socket
    ("10.1.2.3", ["127.0.0.1"], False),
    ("192.0.2.7", ["192.0.2.7", "192.0.2.8"], True),
    ("::ffff:192.0.2.9", ["192.0.2.7"], False),
    ("not an ip", ["192.0.2.7"], False),
])
def test_is_member(ip, hosts, member):
    assert is_member(ip, member_ips(hosts)) is member


def test_the_job_key_is_the_same_on_every_node_and_differs_by_run_and_secret():
    assert wire.job_key(b"s" * 16, "run") == wire.job_key(b"s" * 16, "run")
    assert len({wire.job_key(b"s" * 16, "run"), wire.job_key(b"s" * 16, "run2"), wire.job_key(b"t" * 16, "run")}) == 3
    assert len(wire.job_key(b"s" * 16, "run")) == wire.KEY_BYTES


# -- against a real job ---------------------------------------------------------------------------------------------

def _replica_ports(agent_pid: int) -> list[int]:
    """The ports the agent's replica service listens on (found as an outsider would: the listening sockets)."""
    ports = []
    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            if any("_replica_child.py" in part for part in child.cmdline()):
                ports += [c.laddr.port for c in child.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return ports


def _events(log_dir, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
    return found


def _replica_steps(shm_dirs) -> list[int]:
    steps = []
    for shm_dir in shm_dirs:
        for info in slotfile.inventory(shm_dir, ("replicas",)):
            steps.append(info.step)
    return steps


@pytest.mark.slow
@pytest.mark.long  # in the long part: the suite stays under its 20 minutes
@pytest.mark.parametrize("endpoint", ["c10d"], indirect=True)
def test_an_attacker_of_a_running_job_gets_nothing_and_the_job_restores_its_own_step(endpoint, tmp_path):
    """Two agents (c10d, one worker each) save steps 0..3. The attacker finds each replica port (the listening
    sockets), gets nothing with no key, a wrong key or a replayed answer, puts a forged snapshot of step 10**9
    whose unpickling would run a command, and floods idle connections. Then a worker is SIGKILLed: both nodes
    restore step 3, nothing ran, no forged replica exists, and the job ends cleanly."""
    from tests.helpers import kill_tree, launcher_env, start

    _backend, ep = endpoint
    secret = "correct horse battery staple, 32b"
    out, stop, marker = tmp_path / "out", tmp_path / "stop", tmp_path / "pwned"
    out.mkdir()
    worker = str(SCRIPTS / "ckpt_worker.py")
    agents = {}
    errs = {name: tmp_path / f"{name}.err" for name in "AB"}

    def stderr() -> str:
        return "".join(f"--- {n} ---\n{p.read_text(errors='replace')[-2500:]}\n" for n, p in errs.items())

    for name in "AB":
        with open(errs[name], "w") as err:
            agents[name] = start("elaunch", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                                 f"--rdzv-endpoint={ep}", "--rdzv-id=attacked", "--max-restarts=1",
                                 "--local-addr=127.0.0.1", f"--log-dir={tmp_path / name}", worker, str(out), "4",
                                 "--wait-for", str(stop), env=launcher_env(ELAUNCH_JOB_SECRET=secret),
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: all((out / f"saved_{r}_3").exists() for r in (0, 1)), 120, what=f"step 3\n{stderr()}")
        ports = wait_for(lambda: [p for a in agents.values() for p in _replica_ports(a.pid)] or None, 30,
                         what="the replica services' ports")
        assert len(ports) == 2
        key = wire.job_key(secret.encode(), "attacked")
        forged = tmp_path / "forged"
        write_slot(str(forged), 10**9, b"", meta=pickle.dumps({"w": Boom(str(marker))}), world_size=2, replicated=True)
        for port in ports:
            assert attack(port, "get", "0", "3", key.hex())["served"] > 0  # the probe reaches the service
            for rank in ("0", "1"):
                for how in ("-", WRONG.hex()):
                    assert attack(port, "get", rank, "3", how)["served"] == 0
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, sock.makefile("rb") as rfile:
                rec = _Recorder(sock)
                wire.authenticate_server(rec, rfile, key)
            assert attack(port, "replay", rec.sent.decode().strip(), "0", "3")["served"] == 0
            for how in ("-", WRONG.hex()):
                assert attack(port, "put", str(forged), str(10**9), how)["closed"]
            assert attack(port, "flood", "100", "3")["opened"] == 100
        reports = {p.name[:-5]: json.loads(p.read_text()) for p in out.glob("*.json")}
        shms = [reports[f"{r}_0"]["env"]["ELAUNCH_CHECKPOINT_SHM"] for r in (0, 1)]
        os.kill(reports["1_0"]["pid"], 9)
        wait_for(lambda: all((out / f"{r}_1.json").exists() for r in (0, 1)), 120, what=f"the restart\n{stderr()}")
        again = {r: json.loads((out / f"{r}_1.json").read_text()) for r in (0, 1)}
        assert [again[r]["step"] for r in (0, 1)] == [3, 3] and all(again[r]["state_ok"] for r in (0, 1))
        assert 10**9 not in _replica_steps(shms)
        stop.touch()
        for a in agents.values():
            assert a.wait(90) == 0, stderr()
    finally:
        for a in agents.values():
            kill_tree(a.pid)
    assert not marker.exists()
    restores = [e["step"] for name in "AB" for e in _events(tmp_path / name, "checkpoint_restore")]
    assert restores == [3, 3]
