"""The Kubernetes example's manifests: their parts agree with each other and with elaunch.

``tests/multinode/test_kubernetes_example.py`` runs them; these checks cover what a
run on test hosts cannot show (names, policies, limits) and the pure logic of
``tests/multinode/kube.py`` (the kubelet's ``$(VAR)`` expansion, env order).
"""

from __future__ import annotations

import click
import pytest

from elaunch.cli import main as elaunch_command
from elaunch.cli import parse_config
from elaunch.config.errors import EXIT_USAGE
from tests.conftest import REPO
from tests.multinode import kube

MANIFESTS = REPO / "examples" / "kubernetes"
IPS = ["10.0.0.10", "10.0.0.11"]


@pytest.mark.parametrize("text, env, expected", [
    ("$(A)", {"A": "x"}, "x"),
    ("--local-addr=$(POD_IP)", {"POD_IP": "10.0.0.1"}, "--local-addr=10.0.0.1"),
    ("$(A)-$(B)", {"A": "1", "B": "2"}, "1-2"),
    ("$(MISSING)", {}, "$(MISSING)"),      # undefined: left as written
    ("$$(A)", {"A": "x"}, "$(A)"),         # $$ escapes
    ("$$$(A)", {"A": "x"}, "$x"),
    ("$(A", {"A": "x"}, "$(A"),            # not closed
    ("a$b", {}, "a$b"),                    # $ before anything else
    ("end$", {}, "end$"),
    ("$(A)$(A)", {"A": "$(B)", "B": "no"}, "$(B)$(B)"),  # a value is not expanded again
])
def test_expand_as_kubernetes_does(text, env, expected):
    assert kube.expand(text, env) == expected


def test_env_values_see_only_the_entries_above_them():
    template = {"metadata": {"labels": {}}, "spec": {"containers": [{
        "name": "c", "command": ["echo", "$(B)", "$(JOB_COMPLETION_INDEX)"],
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "$(A)-$(C)-$(JOB_COMPLETION_INDEX)"},
                {"name": "C", "value": "3"}],
    }]}}
    job = {"metadata": {"name": "j"},
           "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "template": template}}
    (pod,) = kube.job_pods(job, ["10.0.0.1"])
    (c,) = pod.containers
    assert c.env["B"] == "1-$(C)-$(JOB_COMPLETION_INDEX)"  # the Job controller appends the index
    assert c.argv == ["echo", "1-$(C)-$(JOB_COMPLETION_INDEX)", "0"]


def test_an_unmodelled_downward_field_is_refused():
    template = {"metadata": {}, "spec": {"containers": [{
        "name": "c", "command": ["true"], "env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
    }]}}
    with pytest.raises(ValueError, match="spec.nodeName"):
        kube.statefulset_pods({"metadata": {"name": "s"}, "spec": {"serviceName": "s", "template": template}}, ["1.2.3.4"])


def _job_pods(name: str) -> tuple[list[dict], dict, list[kube.Pod]]:
    docs = kube.load(MANIFESTS / name)
    job = kube.find(docs, "Job")
    return docs, job, kube.job_pods(job, IPS, uid="0f0e0d0c-uid")


def _trainer(pod: kube.Pod) -> kube.Container:
    (c,) = [c for c in pod.containers if c.name == "trainer"]
    return c


@pytest.mark.parametrize("name, backend, endpoint", [
    ("c10d.yaml", "c10d", "digits-0.digits:29400"),
    ("etcd-v3.yaml", "etcd-v3", "etcd-0.etcd:2379"),
])
def test_the_trainer_is_valid_elaunch_input_in_kubeflow_terms(name, backend, endpoint, monkeypatch):
    docs, job, pods = _job_pods(name)
    monkeypatch.chdir(REPO)  # the image's working directory holds examples/
    known_env = {p.envvar for p in elaunch_command.params if isinstance(p, click.Option)}
    for pod in pods:
        c = _trainer(pod)
        assert c.argv[0] == "elaunch"
        pet = {k for k in c.env if k.startswith("PET_")}
        assert pet <= known_env, f"{name}: not elaunch's PET_* variables: {pet - known_env}"
        cfg = parse_config(c.argv[1:], c.env)
        assert (cfg.min_nodes, cfg.max_nodes) == (1, job["spec"]["completions"])
        assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == (backend, endpoint)
        assert cfg.run_id == "0f0e0d0c-uid"  # the Job's uid, the same on every pod
        assert cfg.local_addr == pod.ip
        assert cfg.max_restarts == 3 and cfg.nproc_per_node == 2
        assert list(cfg.cmd[-3:]) == ["examples/ddp_digits.py", "--epochs=8", "--lr=0.005"]
        # the kubelet's SIGKILL comes after elaunch has stopped its workers
        assert cfg.shutdown_timeout < job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # the init container waits for the very name the trainer uses, with the same env
        (init,) = pod.init_containers
        assert init.env == c.env and init.argv[-1] == endpoint


@pytest.mark.parametrize("name", ["c10d.yaml", "etcd-v3.yaml"])
def test_the_job_fails_at_once_on_bad_input_and_ignores_disruptions(name):
    _, job, _ = _job_pods(name)
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"] == {"containerName": "trainer", "operator": "In", "values": [EXIT_USAGE]}
    assert any(r["action"] == "Ignore" and r["onPodConditions"] == [{"type": "DisruptionTarget"}] for r in rules)


def test_c10d_endpoint_is_pod_0s_published_name():
    docs, job, pods = _job_pods("c10d.yaml")
    records = kube.dns_records(docs, pods)
    host = _trainer(pods[0]).env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[0]
    assert records[host] == pods[0].ip
    assert records[f"{host}.default.svc.cluster.local"] == pods[0].ip
    assert kube.find(docs, "Service", "digits")["spec"]["publishNotReadyAddresses"] is True


def test_etcd_endpoint_is_the_statefulsets_pod_and_its_data_is_on_the_volume():
    docs, job, pods = _job_pods("etcd-v3.yaml")
    (etcd,) = kube.statefulset_pods(kube.find(docs, "StatefulSet", "etcd"), ["10.0.0.2"])
    records = kube.dns_records(docs, [etcd, *pods])
    assert records["etcd-0.etcd"] == "10.0.0.2"
    assert not any(ip in IPS for ip in records.values())  # the training pods need no names
    (c,) = etcd.containers
    assert "--advertise-client-urls=http://etcd-0.etcd:2379" in c.argv
    assert "--initial-cluster=etcd-0=http://etcd-0.etcd:2380" in c.argv
    moved = kube.with_volumes(c, {"data": "/tmp/x"})
    assert "--data-dir=/tmp/x/data" in moved.argv


def test_a_name_is_published_only_for_pods_the_service_selects():
    docs, job, pods = _job_pods("c10d.yaml")
    for pod in pods:
        pod.labels["app"] = "other"
    assert kube.dns_records(docs, pods) == {}


@pytest.mark.parametrize("name", ["c10d.yaml", "etcd-v3.yaml"])
def test_prometheus_scrapes_the_port_the_agent_serves_metrics_on(name, monkeypatch):
    docs, job, pods = _job_pods(name)
    monkeypatch.chdir(REPO)
    template = job["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    port = int(annotations["prometheus.io/port"])
    (spec,) = [c for c in template["spec"]["containers"] if c["name"] == "trainer"]
    assert {"name": "metrics", "containerPort": port} in spec["ports"]  # what a PodMonitor names
    for pod in pods:
        assert parse_config(_trainer(pod).argv[1:], _trainer(pod).env).metrics_port == port
    services = [d for d in docs if d.get("kind") == "Service" and d["spec"]["selector"] == template["metadata"]["labels"]]
    for svc in services:  # a ServiceMonitor finds it through the Service's port of the same name
        assert {"name": "metrics", "port": port} in svc["spec"]["ports"]
    # the Prometheus Operator's PodMonitor selects these pods and that port
    monitor = kube.find(kube.load(MANIFESTS / "podmonitor.yaml"), "PodMonitor")
    (expr,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expr["key"] == "app" and expr["operator"] == "In"
    assert template["metadata"]["labels"]["app"] in expr["values"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
