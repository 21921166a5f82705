"""Kubernetes manifests to the processes a cluster would start: pure logic, no cluster.

Reads the YAML of ``examples/kubernetes/`` and builds, for every pod a Job or a
StatefulSet would create, each container's argv and environment the way the
kubelet does:

* env entries in order; a ``value`` may refer to entries above it as ``$(NAME)``;
  ``valueFrom.fieldRef`` (the downward API) takes the pod's field (``status.podIP``,
  ``metadata.name``, ``metadata.labels['...']``, ...), which the caller supplies;
* an Indexed Job's pods get ``JOB_COMPLETION_INDEX`` (appended, as the Job
  controller does), hostname ``<job>-<index>`` and the labels
  ``batch.kubernetes.io/controller-uid`` and ``batch.kubernetes.io/job-name``;
  a StatefulSet's pod ``<name>-<ordinal>`` gets its ``serviceName`` as subdomain;
* ``command`` and ``args`` are expanded with the container's environment
  (:func:`expand`: ``$(NAME)`` when NAME is defined, ``$$`` for ``$``, anything
  else left as written).

:func:`dns_records` lists the names the cluster DNS would publish for the pods
(``<hostname>.<subdomain>`` and its ``.<namespace>.svc.cluster.local`` form,
for a headless Service whose selector matches the pod and whose name is the
pod's subdomain): the names the manifests rely on, and only those.

Only what the example manifests use is modelled; anything else raises ValueError.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CLUSTER_DOMAIN = "cluster.local"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def load(path: Path) -> list[dict[str, Any]]:
    """The objects of a (multi-document) YAML manifest, empty documents dropped."""
    with open(path) as fp:
        return [doc for doc in yaml.safe_load_all(fp) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``, if given) in ``docs``.

    Raises:
        ValueError: none or more than one matches.
    """
    found = [d for d in docs if d.get("kind") == kind and name in (None, d["metadata"]["name"])]
    if len(found) != 1:
        raise ValueError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def expand(text: str, env: dict[str, str]) -> str:
    """Expand ``$(NAME)`` references in ``text`` as Kubernetes does (its ``expansion`` package).

    ``$(NAME)`` becomes ``env[NAME]`` when NAME is defined, and stays as written when
    not; ``$$`` becomes ``$``; a ``$`` before anything else, or ``$(`` without a
    closing parenthesis, stays as written.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "$" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(c + nxt)
            i += 2
    return "".join(out)


@dataclass
class Container:
    """One container of a pod as the kubelet would start it.

    Attributes:
        name: the container's name.
        image: its image (not used to run anything here).
        argv: ``command + args``, expanded.
        env: its environment from the manifest (the image's own is not included).
        mounts: ``mountPath -> volume name``.
    """

    name: str
    image: str
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, str] = field(default_factory=dict)


@dataclass
class Pod:
    """A pod a controller would create: its identity and its containers (init ones first).

    Attributes:
        name: ``metadata.name``.
        hostname: the pod's hostname; ``subdomain`` its subdomain ('' for none).
        namespace: ``metadata.namespace`` (``default`` when the manifest says none).
        labels: the template's labels plus those the controller adds.
        ip: the address given for ``status.podIP``.
    """

    name: str
    hostname: str
    subdomain: str
    namespace: str
    labels: dict[str, str]
    ip: str
    init_containers: list[Container]
    containers: list[Container]


def _field(path: str, fields: dict[str, str]) -> str:
    if path not in fields:
        raise ValueError(f"downward API field {path!r} is not modelled (known: {sorted(fields)})")
    return fields[path]


def _container(spec: dict[str, Any], fields: dict[str, str], injected: dict[str, str]) -> Container:
    env: dict[str, str] = {}
    for entry in spec.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = _field(entry["valueFrom"]["fieldRef"]["fieldPath"], fields)
        else:
            raise ValueError(f"env {entry['name']!r}: only value and valueFrom.fieldRef are modelled")
    env.update(injected)
    if "command" not in spec:
        raise ValueError(f"container {spec['name']!r} has no command: the image's entrypoint is unknown here")
    argv = [expand(str(a), env) for a in [*spec["command"], *spec.get("args", [])]]
    mounts = {m["mountPath"]: m["name"] for m in spec.get("volumeMounts", [])}
    return Container(spec["name"], spec.get("image", ""), argv, env, mounts)


def _pod(template: dict[str, Any], name: str, hostname: str, subdomain: str, namespace: str,
         labels: dict[str, str], annotations: dict[str, str], ip: str, injected: dict[str, str]) -> Pod:
    spec = template["spec"]
    fields = {
        "metadata.name": name,
        "metadata.namespace": namespace,
        "status.podIP": ip,
        **{f"metadata.labels['{k}']": v for k, v in labels.items()},
        **{f"metadata.annotations['{k}']": v for k, v in annotations.items()},
    }
    return Pod(
        name, hostname, subdomain, namespace, labels, ip,
        [_container(c, fields, injected) for c in spec.get("initContainers", [])],
        [_container(c, fields, injected) for c in spec["containers"]],
    )


def job_pods(job: dict[str, Any], ips: list[str], uid: str | None = None) -> list[Pod]:
    """The pods of an Indexed Job, pod ``i`` with ``status.podIP = ips[i]``.

    Args:
        job: the Job object; ``ips``: one address per completion index.
        uid: the Job's uid (``batch.kubernetes.io/controller-uid``); a fresh one by default.

    Raises:
        ValueError: not an Indexed Job with parallelism == completions == len(ips).
    """
    spec = job["spec"]
    n = spec.get("completions")
    if spec.get("completionMode") != "Indexed" or spec.get("parallelism") != n or n != len(ips):
        raise ValueError(f"expected an Indexed Job with parallelism == completions == {len(ips)}")
    jname = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    uid = uid or str(uuid.uuid4())
    template = spec["template"]
    pods = []
    for i, ip in enumerate(ips):
        labels = {**template["metadata"].get("labels", {}), "batch.kubernetes.io/controller-uid": uid,
                  "batch.kubernetes.io/job-name": jname, "controller-uid": uid, "job-name": jname,
                  "batch.kubernetes.io/job-completion-index": str(i)}
        annotations = {INDEX_ANNOTATION: str(i)}
        name = f"{jname}-{i}-{uuid.uuid4().hex[:5]}"
        pods.append(_pod(template, name, f"{jname}-{i}", template["spec"].get("subdomain", ""), namespace,
                         labels, annotations, ip, {"JOB_COMPLETION_INDEX": str(i)}))
    return pods


def statefulset_pods(sts: dict[str, Any], ips: list[str]) -> list[Pod]:
    """The pods ``<name>-0 .. <name>-(n-1)`` of a StatefulSet, pod ``i`` at ``ips[i]``.

    Raises:
        ValueError: ``replicas`` is not ``len(ips)``.
    """
    spec = sts["spec"]
    if spec.get("replicas", 1) != len(ips):
        raise ValueError(f"expected a StatefulSet with {len(ips)} replicas")
    sname = sts["metadata"]["name"]
    namespace = sts["metadata"].get("namespace", "default")
    template = spec["template"]
    pods = []
    for i, ip in enumerate(ips):
        name = f"{sname}-{i}"
        labels = {**template["metadata"].get("labels", {}), "statefulset.kubernetes.io/pod-name": name,
                  "apps.kubernetes.io/pod-index": str(i)}
        pods.append(_pod(template, name, name, spec["serviceName"], namespace, labels, {}, ip, {}))
    return pods


def dns_records(docs: list[dict[str, Any]], pods: list[Pod]) -> dict[str, str]:
    """The pod names the cluster DNS would publish: ``name -> address``.

    A pod gets ``<hostname>.<subdomain>`` (what a search domain completes) and
    ``<hostname>.<subdomain>.<namespace>.svc.cluster.local`` when a headless Service
    named like its subdomain, in its namespace, selects it by its labels.
    """
    records = {}
    for svc in (d for d in docs if d.get("kind") == "Service"):
        spec = svc["spec"]
        if spec.get("clusterIP") != "None":
            continue
        sname = svc["metadata"]["name"]
        namespace = svc["metadata"].get("namespace", "default")
        selector = spec.get("selector", {})
        for pod in pods:
            if pod.subdomain != sname or pod.namespace != namespace:
                continue
            if not selector or any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            short = f"{pod.hostname}.{sname}"
            records[short] = pod.ip
            records[f"{short}.{namespace}.svc.{CLUSTER_DOMAIN}"] = pod.ip
    return records


def with_volumes(container: Container, dirs: dict[str, str]) -> Container:
    """``container`` with each mount path in its argv and env replaced by ``dirs[volume name]``.

    There are no volumes here: a directory stands for each, and the paths the
    container is given change accordingly.
    """
    def sub(s: str) -> str:
        for path, vol in container.mounts.items():
            s = s.replace(path.rstrip("/"), dirs[vol])
        return s

    return Container(container.name, container.image, [sub(a) for a in container.argv],
                     {k: sub(v) for k, v in container.env.items()}, dict(container.mounts))
