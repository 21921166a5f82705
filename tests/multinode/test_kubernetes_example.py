"""The Kubernetes example (``examples/kubernetes/``) run as its manifests say, on test hosts.

There is no cluster here. Each pod a manifest's Job or StatefulSet would create
runs in a host of its own (a network namespace, ``tests/multinode/netns.py``),
with its containers' argv and environment built from the YAML as the kubelet
would (``tests/multinode/kube.py``): init containers first, to completion, then
the container. The test appends no flag and sets no variable of the job's.

What stands in for the cluster:

* the pod's IP is its host's address (``status.podIP``), the Job's uid a fresh
  UUID (``batch.kubernetes.io/controller-uid``), ``JOB_COMPLETION_INDEX`` the index;
* DNS: the names the cluster would publish for the pods (``kube.dns_records``:
  headless Service, selector, subdomain) go into each host's ``/etc/hosts``
  (``Host.set_hosts``), so ``digits-0.digits`` and ``etcd-0.etcd`` resolve to the
  hosts' addresses and the manifests' strings are used unchanged;
* the image: its environment is this test's (``PATH`` starts with the venv's
  ``bin``, which holds ``elaunch`` and ``python``; ``etcd`` is the one
  ``scripts/install-etcd.sh`` installs, 3.4, where the manifest names a 3.5 image);
  its working directory (``/opt/elaunch`` in the Dockerfile) is a directory per pod
  with this repository's ``examples/`` linked in, so each pod writes its
  checkpoints in its own file system;
* a volume is a directory per pod: its mount path in argv and env is replaced by
  that directory (``kube.with_volumes``; etcd's ``--data-dir``).

The c10d Job's pods are scraped while they train by a real Prometheus in a host of
its own, at the addresses and port their ``prometheus.io/*`` annotations name (the
targets are written from the annotations; Kubernetes service discovery is not run).

Not run: an image build, a cluster, the kubelet (restart policy, grace period,
resources, probes), the Job controller (backoff, pod failure policy, replacement).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, wait_for
from tests.helpers import launcher_env
from tests.multinode import kube, netns
from tests.multinode.conftest import etcd_unavailable_reason, no_processes_in
from tests.prometheus_server import PrometheusServer, ensure_prometheus

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

MANIFESTS = REPO / "examples" / "kubernetes"
#: The venv's bin stands for the image's PATH: elaunch and python are there.
IMAGE_PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
#: Seconds the training pods get to finish (the job trains 8 epochs of the digits example).
JOB_TIMEOUT = 120


class PodRun:
    """One pod running in ``host``: its init containers run, its container started.

    Attributes:
        root: the pod's file system (stands for the image's working directory).
        proc: the container's process (``ip netns exec`` execs, so it is the command's pid).
        out, err: the container's stdout and stderr files (what ``kubectl logs`` shows).
    """

    def __init__(self, host: netns.Host, pod: kube.Pod, tmp: Path) -> None:
        self.host, self.pod = host, pod
        self.root = tmp / pod.name
        self.root.mkdir()
        (self.root / "examples").symlink_to(REPO / "examples")
        (container,) = pod.containers
        for init in pod.init_containers:
            res = subprocess.run(host.cmd(self._resolved(init).argv), cwd=self.root, env=self._env(init),
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, f"{pod.name}: init container {init.name} failed\n{res.stdout}\n{res.stderr}"
        self.container = self._resolved(container)
        self.out, self.err = tmp / f"{pod.name}.out", tmp / f"{pod.name}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = host.popen(self.container.argv, cwd=self.root, env=self._env(self.container),
                                   stdout=o, stderr=e)

    def _resolved(self, c: kube.Container) -> kube.Container:
        dirs = {}
        for vol in c.mounts.values():
            dirs[vol] = str(self.root / "volumes" / vol)
            os.makedirs(dirs[vol], exist_ok=True)
        return kube.with_volumes(c, dirs)

    @staticmethod
    def _env(c: kube.Container) -> dict[str, str]:
        return {**launcher_env(PATH=IMAGE_PATH), **c.env}

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the container to exit; its exit code.

        Raises:
            AssertionError: still running (it is killed; its logs are in the message).
        """
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self.pod.name} did not exit within {timeout}s\n{self.logs()}") from None

    def stop(self) -> int:
        """SIGTERM, as the kubelet stops a container; SIGKILL after 10 s. Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=10)

    def logs(self) -> str:
        return (f"--- {self.pod.name} stdout ---\n{self.out.read_text(errors='replace')[-3000:]}\n"
                f"--- {self.pod.name} stderr ---\n{self.err.read_text(errors='replace')[-3000:]}")


def _hosts(net: netns.Network, n: int) -> list[netns.Host]:
    return [net.add_host() for _ in range(n)]


class Scraper:
    """A Prometheus in a host of its own, scraping each pod where the Job's pod annotations say.

    This is what an annotation-based Prometheus configuration (``prometheus.io/scrape``,
    ``/port``, ``/path``; the kubernetes-pods job) would scrape; Kubernetes service
    discovery itself is not run, the targets are written from the same annotations.
    """

    def __init__(self, net: netns.Network, job: dict, pods: list[kube.Pod], tmp: Path) -> None:
        meta = job["spec"]["template"]["metadata"].get("annotations", {})
        assert meta.get("prometheus.io/scrape") == "true", "the Job's pods are not marked for scraping"
        self.targets = [f"{p.ip}:{meta['prometheus.io/port']}" for p in pods]
        self.host = net.add_host()
        self.host.service = True
        self.server = PrometheusServer(tmp / "prometheus", self.targets, host=self.host.addr,
                                       cmd_prefix=self.host.cmd([]))
        self.server.start()

    def check(self, runs: list[PodRun]) -> None:
        """While the pods train: every agent's /metrics was scraped, each in one round of all the pods."""
        seen: list = []

        def done() -> bool:
            if any(r.proc.poll() is not None for r in runs):
                raise AssertionError("a pod exited before Prometheus scraped every agent\n"
                                     + "\n".join(r.logs() for r in runs))
            seen[:] = self.server.query("elaunch_rendezvous_rounds_total")
            return sorted(s["metric"]["instance"] for s in seen if s["value"] == 1) == sorted(self.targets)
        try:
            wait_for(done, 60, interval=0.5, what=f"Prometheus scraping {self.targets}")
        except AssertionError as e:
            targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.server.active_targets()]
            raise AssertionError(f"{e}\nrounds: {seen}\ntargets: {targets}\n{self.server.log_tail()}") from None
        sizes = self.server.query("elaunch_workers")
        assert {s["metric"]["instance"] for s in sizes} == set(self.targets), sizes


def _run_job(job_pods: list[tuple[netns.Host, kube.Pod]], tmp: Path, others=(), scraper: Scraper | None = None) -> None:
    """Start the job's pods, wait for all to exit 0; check the training's result on rank 0's pod."""
    runs = [PodRun(h, p, tmp) for h, p in job_pods]
    started = time.monotonic()
    try:
        if scraper is not None:
            scraper.check(runs)
        codes = [r.wait(max(1.0, JOB_TIMEOUT - (time.monotonic() - started))) for r in runs]
        logs = "\n".join(r.logs() for r in [*runs, *others])
        assert codes == [0] * len(runs), logs
        outs = [r.out.read_text() for r in runs]
        rank0 = [o for o in outs if "final test accuracy" in o]
        assert len(rank0) == 1, logs  # one pod holds rank 0
        (out,) = rank0
        assert "epoch 8/8" in out, logs
        acc = float(re.findall(r"final test accuracy: ([0-9.]+)", out)[-1])
        assert acc >= 0.95, logs
        # the training ran in one world of all the pods: rank 0's checkpoint (written in its
        # own pod's file system, at the example's default path) says so
        world = len(runs) * int(runs[0].container.env["PET_NPROC_PER_NODE"])
        (holder,) = [r for r, o in zip(runs, outs) if o is out]
        ckpt = holder.root / "runs" / f"ddp_digits-{holder.container.env['PET_RDZV_ID']}" / "checkpoint.pt"
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        assert (state["epoch"], state["world_size"]) == (8, world), logs
        assert "resumed from" not in out, logs  # no second round
    finally:
        for r in runs:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(timeout=10)


def test_c10d_manifest_trains_on_two_pods(net, tmp_path):
    docs = kube.load(MANIFESTS / "c10d.yaml")
    job = kube.find(docs, "Job")
    hosts = _hosts(net, job["spec"]["completions"])
    pods = kube.job_pods(job, [h.addr for h in hosts])
    records = kube.dns_records(docs, pods)
    assert "digits-0.digits" in records  # the name PET_RDZV_ENDPOINT uses is one the cluster publishes
    for h in hosts:
        h.set_hosts(records)
    if ensure_prometheus() is None:
        pytest.skip("prometheus is not installed and scripts/install-prometheus.sh could not install it")
    scraper = Scraper(net, job, pods, tmp_path)  # before the pods: its first scrape comes ~5 s after it starts
    try:
        _run_job(list(zip(hosts, pods)), tmp_path, scraper=scraper)
    finally:
        scraper.server.stop()
    no_processes_in([*hosts, scraper.host])


def test_etcd_v3_manifest_trains_on_two_pods(net, tmp_path):
    reason = etcd_unavailable_reason("etcd-v3")
    if reason:
        pytest.skip(f"etcd-v3: {reason}")
    docs = kube.load(MANIFESTS / "etcd-v3.yaml")
    job = kube.find(docs, "Job")
    sts = kube.find(docs, "StatefulSet", "etcd")
    etcd_host, *hosts = _hosts(net, 1 + job["spec"]["completions"])
    (etcd_pod,) = kube.statefulset_pods(sts, [etcd_host.addr])
    pods = kube.job_pods(job, [h.addr for h in hosts])
    records = kube.dns_records(docs, [etcd_pod, *pods])
    assert "etcd-0.etcd" in records
    for h in (etcd_host, *hosts):
        h.set_hosts(records)
    etcd = PodRun(etcd_host, etcd_pod, tmp_path)  # the training pods start at once, as with kubectl apply
    try:
        _run_job(list(zip(hosts, pods)), tmp_path, others=[etcd])
        assert etcd.proc.poll() is None, etcd.logs()  # etcd served the whole job
    finally:
        etcd.stop()
    no_processes_in([etcd_host, *hosts])
