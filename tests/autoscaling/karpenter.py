"""Karpenter (its kwok cloud provider) and kwok as processes of the autoscaling tier, the pool they scale, and
the packing a scale-up is measured against.

The pool: one instance type, ``gpu-8x``, a node of 8 cards that advertises what gpushard's agent advertises on a
shared node (each card's ``gpushard.io/card-<k>`` shares and the node's ``gpushard.io/gpu``), and one NodePool,
``gpu``, whose nodes carry the labels the agent publishes (``gpushard.io/cards``, each card's memory) and are
removed ``CONSOLIDATE_AFTER`` after their last pod went. Karpenter's kwok provider writes each Node it makes
with the instance type's resources as allocatable; kwok makes it Ready, keeps its lease and plays its pods.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from tests.e2e import components
from webhook.core import names

CARDS, SHARES, MEMORY_MIB = 8, 100, 81559
POOL = "gpu"
INSTANCE_TYPE = "gpu-8x"
CONSOLIDATE_AFTER = "5s"


def instance_types() -> list[dict]:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "gpushard.io/gpu": str(CARDS * SHARES),
                 **{f"gpushard.io/card-{k}": str(SHARES) for k in range(CARDS)}}
    offering = {"Price": 8.0, "Available": True, "Requirements": [
        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-a"]}]}
    return [{"name": INSTANCE_TYPE, "offerings": [offering], "architecture": "amd64",
             "operatingSystems": ["linux"], "resources": resources}]


def node_pool() -> dict:
    labels = {names.CARDS_LABEL: str(CARDS), **{names.card_memory_label(k): str(MEMORY_MIB) for k in range(CARDS)}}
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": POOL}, "spec": {
        "template": {"metadata": {"labels": labels}, "spec": {
            "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
            "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                              "values": [INSTANCE_TYPE]}],
            "expireAfter": "Never"}},
        "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": CONSOLIDATE_AFTER,
                       "budgets": [{"nodes": "100%"}]}}}


class Kwok:
    """kwok's controller over the nodes Karpenter's kwok provider makes (they carry its annotation)."""

    def __init__(self, folder: Path, plane: components.ControlPlane, work: Path):
        self.folder, self.plane, self.work = folder, plane, work
        self.process: components.Process | None = None

    def start(self) -> None:
        stages = self.work / "kwok-stages.yaml"
        stages.write_text("\n---\n".join(p.read_text() for p in sorted((self.folder / "stages").glob("*.yaml"))))
        home = self.work / "kwok-home"
        home.mkdir(exist_ok=True)
        self.process = components.Process("kwok", [
            str(self.folder / "kwok"), f"--kubeconfig={self.plane.admin_config()}", f"--config={stages}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-lease-duration-seconds=40",
            "--cidr=10.64.0.0/16", f"--server-address=127.0.0.1:{components.free_port()}",
            f"--node-port={components.free_port()}"], self.work / "kwok.log",
            env={**os.environ, "HOME": str(home)}).start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


class Karpenter:
    """Karpenter's kwok provider: its CRDs, the pool, and the controller, leader election off."""

    def __init__(self, folder: Path, plane: components.ControlPlane, work: Path):
        self.folder, self.plane, self.work = folder, plane, work
        self.process: components.Process | None = None
        self.health = components.free_port()

    def start(self) -> None:
        kubectl = self.plane.kubectl
        crds = sorted((self.folder / "crds").glob("*.yaml"))
        for crd in crds:
            kubectl.run("apply", "--server-side", "-f", str(crd), timeout=60)
        kubectl.run("wait", "--for=condition=Established", "--timeout=60s",
                    *(f"crd/{c.name.split('_', 1)[1].removesuffix('.yaml')}.{c.name.split('_', 1)[0]}"
                      for c in crds), timeout=90)
        types = self.work / "instance-types.json"
        types.write_text(json.dumps(instance_types()))
        env = {**os.environ, "KUBECONFIG": str(self.plane.admin_config()), "DISABLE_LEADER_ELECTION": "true",
               "METRICS_PORT": str(components.free_port()), "HEALTH_PROBE_PORT": str(self.health),
               "INSTANCE_TYPES_FILE_PATH": str(types), "BATCH_IDLE_DURATION": "1s", "BATCH_MAX_DURATION": "3s",
               "LOG_LEVEL": "debug"}
        self.process = components.Process("karpenter", [str(self.folder / "kwok")], self.work / "karpenter.log",
                                          env=env).start()
        components.wait_for("Karpenter's /readyz", self._ready, timeout=120, explain=self.tail)
        kubectl.apply(json.dumps({"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
                                  "metadata": {"name": "default"}}))
        kubectl.apply(json.dumps(node_pool()))
        components.wait_for(f"NodePool {POOL} Ready", lambda: any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in kubectl.json("get", "nodepool", POOL).get("status", {}).get("conditions", [])),
            timeout=60, explain=self.tail)

    def _ready(self) -> bool:
        if not self.process.alive():
            raise AssertionError(f"Karpenter exited:\n{self.tail()}")
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.health}/readyz", timeout=3).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


def packing_needs(sizes: list[int], cards: int = CARDS, shares: int = SHARES) -> int:
    """The nodes of ``cards`` cards that first-fit-decreasing fills with pods of ``sizes`` shares, one card each:
    what a scale-up for them should add."""
    nodes: list[list[int]] = []
    for size in sorted(sizes, reverse=True):
        for node in nodes:
            k = next((k for k, used in enumerate(node) if used + size <= shares), None)
            if k is not None:
                node[k] += size
                break
        else:
            nodes.append([size] + [0] * (cards - 1))
    return len(nodes)


def table(rows: list[dict]) -> str:
    header = ("scenario", "pods", "nodes added", "a packing needs", "first create to last bind s",
              "nodes that hold none of them", "cards over their shares", "nodes removed after", "removed in s")
    lines = [header] + [tuple(str(r.get(h, "-")) for h in header) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "gpushard autoscaling:\n" + "\n".join("  " + " | ".join(c.ljust(w) for c, w in zip(line, widths,
                                                                                               strict=True))
                                                  for line in lines)
