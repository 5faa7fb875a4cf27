"""What the fault tests of the install tiers share (tests/runtime_install and tests/runtime_install_dra): gpushard's
own pods and containers, and a node that reboots."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from tests.e2e import gpushard
from tests.runtime import node

SYSTEM = gpushard.SYSTEM


def container_of(kubectl, component: str) -> tuple[str, str]:
    pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get(
        "deletionTimestamp")]
    pod = sorted(running, key=lambda p: p["metadata"]["name"])[0]
    return pod["metadata"]["name"], pod["status"]["containerStatuses"][0]["containerID"].split("://")[1]


def ready_webhooks(kubectl) -> int:
    return kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["status"].get("readyReplicas", 0)


def reboot(kubelet, runtime, volatile: tuple[Path, ...] = ()) -> None:
    """The node powered off and on: the kubelet, containerd, every container and shim killed at once, their mounts
    and the runtime's state gone, and what ``volatile`` folders held (a tmpfs on a node: /var/run/cdi); the
    kubelet's folder (its checkpoints) and containerd's root kept, as on a disk. Then containerd and the kubelet
    start again, as the node's init system starts them."""
    os.killpg(kubelet.process.proc.pid, signal.SIGKILL)
    kubelet.process.proc.wait(10)
    runtime.power_cut()
    node.unmount_under(kubelet.root)
    for folder in volatile:
        for entry in folder.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    runtime.start()
    kubelet.process.start()


def seeing_ready(pod: dict) -> bool:
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all(s.get("state", {}).get("running") for s in statuses)
