"""A small but realistic cluster for the audit and status tests: namespaces in every mode, three kinds of node."""

from __future__ import annotations

import json

from tests import fakekube
from webhook.core import quantities

H100 = "NVIDIA H100 80GB HBM3"
L4 = "NVIDIA L4"


def namespace(name: str, mode: str | None = None) -> dict:
    labels = {"kubernetes.io/metadata.name": name}
    if mode is not None:
        labels["gpushard.io/mode"] = mode
    return {"metadata": {"name": name, "labels": labels}}


def shared_node(name: str, cards: int, model: str, extra: dict | None = None) -> dict:
    inventory = [{"index": k, "uuid": f"GPU-{name}-{k}", "model": model, "memoryMiB": 81559} for k in range(cards)]
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110", "gpushard.io/gpu": str(100 * cards),
                   **{f"gpushard.io/card-{k}": "100" for k in range(cards)}, **(extra or {})}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "gpushard.io/cards": str(cards)},
                     "annotations": {"gpushard.io/inventory": json.dumps(inventory)}},
        "status": {"allocatable": allocatable, "capacity": allocatable,
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


def plain_node(name: str) -> dict:
    allocatable = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "4"}
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"allocatable": allocatable, "capacity": allocatable,
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def container(name: str, limits: dict | None = None, env: dict | None = None) -> dict:
    out: dict = {"name": name, "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"}
    if limits:
        out["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    if env:
        out["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return out


def pinned(name: str, card: int, shares: int) -> dict:
    """A container as gpushard writes it."""
    return container(name, {"gpushard.io/gpu": str(shares), f"gpushard.io/card-{card}": str(shares)},
                     {"NVIDIA_VISIBLE_DEVICES": str(card), "GPUSHARD_FRACTION": quantities.fraction_text(shares, 100)})


def hidden(name: str) -> dict:
    return container(name, env={"NVIDIA_VISIBLE_DEVICES": "void"})


def sidecar(name: str, env: dict | None = None) -> dict:
    """An init container that keeps running beside the app containers."""
    return container(name, env=env) | {"restartPolicy": "Always"}


def debugger(name: str, env: dict | None = None) -> dict:
    """An ephemeral container, as `kubectl debug` adds to a running pod (no resources allowed)."""
    return container(name, env=env) | {"targetContainerName": "train"}


def pod(ns: str, name: str, containers: list[dict], node: str | None = None, phase: str = "Running",
        card: int | None = None, shares: int | None = None, init: list[dict] | None = None,
        ephemeral: list[dict] | None = None) -> dict:
    meta: dict = {"name": name, "namespace": ns}
    if card is not None:
        meta["annotations"] = {"gpushard.io/card": str(card), "gpushard.io/shares": str(shares)}
        meta["labels"] = {"gpushard.io/shared": "true"}
    spec: dict = {"containers": containers}
    if init:
        spec["initContainers"] = init
    if ephemeral:
        spec["ephemeralContainers"] = ephemeral
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase if node else "Pending"}}


def deployment(ns: str, name: str, containers: list[dict]) -> dict:
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": containers}}}}


def populate(fake: fakekube.FakeKube) -> None:
    """Namespaces: ml (enforce), lab (audit), research and kube-system (unlabelled), legacy (bad label)."""
    for ns, mode in (("ml", "enforce"), ("lab", "audit"), ("research", None), ("kube-system", None),
                     ("legacy", "Enforce")):
        fake.put("namespaces", namespace(ns, mode))
    fake.put("nodes", shared_node("gpu-8x", 8, H100))
    fake.put("nodes", shared_node("gpu-2x", 2, L4, extra={"nvidia.com/gpu": "2"}))  # NVIDIA's plugin left on
    fake.put("nodes", plain_node("cpu-1"))

    pods = [
        # Admitted by gpushard in enforce mode: clean, and so is a debug container it hid.
        pod("ml", "train-a", [pinned("train", 0, 50), hidden("logs")], "gpu-8x", card=0, shares=50,
            ephemeral=[debugger("debug", {"NVIDIA_VISIBLE_DEVICES": "void"})]),
        # A debug container added before the namespace opted in: it sees every card.
        pod("ml", "train-b", [pinned("train", 0, 25)], "gpu-8x", card=0, shares=25, ephemeral=[debugger("debug")]),
        pod("ml", "infer-c", [pinned("server", 3, 100)], "gpu-8x", card=3, shares=100),
        # Finished pods hold nothing, whatever they once asked.
        pod("ml", "done", [pinned("train", 1, 100)], "gpu-8x", "Succeeded", card=1, shares=100),
        pod("ml", "crashed", [container("train", {"gpushard.io/gpu": "30"})], "gpu-2x", "Failed"),
        # Pending, pinned, not yet bound to a node.
        pod("ml", "waiting", [pinned("train", 5, 20)], card=5, shares=20),
        # Created before the namespace opted in: shares of no particular card.
        pod("ml", "loose", [container("train", {"gpushard.io/gpu": "30"})], "gpu-2x"),
        # Audit mode: pinned by hand, and a GPU-less sidecar that can see every card.
        pod("lab", "notebook", [pinned("jupyter", 1, 40), container("proxy")], "gpu-2x"),
        # Asking no GPU on a shared node: hidden by gpushard in enforce mode, made before the namespace
        # opted in (init container, sidecar, app container), and in audit mode, where nothing is hidden.
        pod("ml", "fetch", [hidden("fetch")], "gpu-8x"),
        pod("ml", "etl", [container("etl"), hidden("logs")], "gpu-8x",
            init=[container("download"), sidecar("metrics")]),
        pod("lab", "shell", [container("shell")], "gpu-2x"),
        # Asking no GPU and no business of this rule: off shared nodes, not opted in, not yet on a node.
        pod("ml", "web", [container("nginx")], "cpu-1"),
        pod("research", "tensorboard", [container("tensorboard")], "gpu-8x"),
        pod("kube-system", "gpushard-agent-gpu-8x", [container("agent")], "gpu-8x"),
        pod("ml", "queued", [container("etl")]),
        # Not opted in: one on a shared node through NVIDIA's plugin, one on a plain GPU node.
        pod("research", "legacy", [container("train", {"nvidia.com/gpu": "1"})], "gpu-2x"),
        pod("research", "plain", [container("train", {"nvidia.com/gpu": "1"})], "cpu-1"),
        pod("research", "web", [container("nginx")], "cpu-1"),
        pod("kube-system", "coredns", [container("coredns")], "cpu-1"),
        # A bad mode label; the pin and the env disagree.
        pod("legacy", "batch", [pinned("train", 2, 60) | {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]}],
            "gpu-8x", card=2, shares=60),
    ]
    for p in pods:
        fake.put("pods", p)

    fake.put("deployments", deployment("ml", "serve", [container("server", {"gpushard.io/gpu": "25"})]))
    fake.put("deployments", deployment("research", "trainer", [container("train", {"nvidia.com/gpu": "1"})]))
    owned = deployment("ml", "serve-7d9f", [container("server", {"gpushard.io/gpu": "25"})])
    owned["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "serve",
                                             "uid": "uid-serve", "controller": True}]
    fake.put("replicasets", owned)
    fake.put("jobs", {"metadata": {"name": "eval", "namespace": "lab"},
                      "spec": {"template": {"spec": {"restartPolicy": "Never",
                                                     "containers": [pinned("eval", 0, 10)]}}}})


# (kind, namespace/name, rule) the audit of this cluster must report, and nothing else.
EXPECTED = {
    ("Namespace", "legacy", "bad-mode-label"),
    ("Node", "gpu-2x", "nvidia-plugin-on-shared-node"),
    ("Pod", "ml/loose", "unpinned"),
    ("Pod", "lab/notebook", "unhidden"),
    ("Pod", "lab/shell", "unhidden"),
    ("Pod", "ml/etl", "unhidden"),
    ("Pod", "ml/train-b", "unhidden"),
    ("Pod", "research/legacy", "not-opted-in"),
    ("Pod", "research/legacy", "nvidia-gpu-on-shared-node"),
    ("Pod", "research/plain", "not-opted-in"),
    ("Deployment", "research/trainer", "not-opted-in"),
    ("Pod", "legacy/batch", "pin-env-mismatch"),
}


def kubeconfig(fake: fakekube.FakeKube) -> str:
    """A kubeconfig document that points the kubernetes client at ``fake``, with no credentials."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fake\n  cluster: {{server: '{fake.url}'}}\n"
        "users:\n- name: nobody\n  user: {}\n"
        "contexts:\n- name: fake\n  context: {cluster: fake, user: nobody}\n"
        "current-context: fake\n"
    )
