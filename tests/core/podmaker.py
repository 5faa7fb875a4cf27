"""Small builders for pods and workloads, so that tests read as the manifests users write."""

from __future__ import annotations

import copy


def container(name: str = "main", gpu: object = None, *, resource: str = "nvidia.com/gpu",
              requests: object = None, env: list | None = None, extra: dict | None = None,
              restart: str | None = None) -> dict:
    c: dict = {"name": name, "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"}
    limits = {"cpu": "1"}
    reqs: dict = {"cpu": "500m"}
    if gpu is not None:
        limits[resource] = gpu
        reqs[resource] = gpu if requests is None else requests
    if extra:
        for key, value in extra.items():
            limits[key] = value
            reqs[key] = value
    c["resources"] = {"limits": limits, "requests": reqs}
    if env is not None:
        c["env"] = env
    if restart:
        c["restartPolicy"] = restart
    return c


def pod(*containers: dict, init: tuple = (), name: str = "p", spec: dict | None = None,
        labels: dict | None = None) -> dict:
    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "team-a", "labels": dict(labels or {})},
           "spec": {"containers": [copy.deepcopy(c) for c in containers]}}
    if init:
        obj["spec"]["initContainers"] = [copy.deepcopy(c) for c in init]
    if spec:
        obj["spec"].update(copy.deepcopy(spec))
    return obj


def deployment(*containers: dict, name: str = "d") -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [copy.deepcopy(c) for c in containers]}}}}


def env_of(c: dict, name: str) -> list:
    return [e.get("value") for e in c.get("env") or [] if e.get("name") == name]
