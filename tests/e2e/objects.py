"""Manifests the end-to-end tests create, as a user would write them."""

from __future__ import annotations

import json


def container(name: str = "main", gpu: str | None = None, resource: str = "nvidia.com/gpu", env: dict | None = None,
              image: str = "registry.example/cuda:12") -> dict:
    c: dict = {"name": name, "image": image, "command": ["sleep", "3600"]}
    if gpu is not None:
        c["resources"] = {"limits": {resource: gpu}}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return c


def pod(name: str, *containers: dict, annotations: dict | None = None, **spec) -> str:
    metadata: dict = {"name": name}
    if annotations:
        metadata["annotations"] = annotations
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                       "spec": {"containers": list(containers) or [container()],
                                "terminationGracePeriodSeconds": 0, **spec}})


def deployment(name: str, gpu: str | None, replicas: int = 2) -> str:
    labels = {"app": name}
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [container(gpu=gpu)], "terminationGracePeriodSeconds": 0}}},
    })


def quota(name: str, hard: dict) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name},
                       "spec": {"hard": hard}})


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c.get("env", [])}
