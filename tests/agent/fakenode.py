"""A fake node for the agent's metrics: a /proc tree of cgroup files, pods as the API lists them,
the kubelet's PodResources, and NVML's process lists, kept consistent with each other."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from tests.agent import fakepodresources
from webhook.agent.node import nvml
from webhook.agent.proto import podresources_pb2 as pb

MIB = nvml.MIB
# How each container runtime and cgroup driver names a container's cgroup (see webhook/agent/metrics/attributing.py).
LAYOUTS = {
    "cgroupfs-v1": lambda uid, cid: "\n".join([
        f"12:memory:/kubepods/burstable/pod{uid}/{cid}", f"11:cpu,cpuacct:/kubepods/burstable/pod{uid}/{cid}",
        "1:name=systemd:/", ""]),
    "systemd-v2-containerd": lambda uid, cid: (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
        f"cri-containerd-{cid}.scope\n"),
    "systemd-v2-crio": lambda uid, cid: (
        f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/crio-{cid}.scope\n"),
}


def container_id(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


@dataclass
class Container:
    name: str
    card: int | None = None  # None: holds no shares
    shares: int = 0
    first: int = 0
    restarts: int = 0
    processes: list[tuple] = field(default_factory=list)  # (pid, MiB) or (pid, MiB, SM %) on its card

    def cid(self, pod: Pod) -> str:
        return container_id(pod.namespace, pod.name, self.name, str(self.restarts))


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]
    layout: str = "systemd-v2-containerd"

    @property
    def uid(self) -> str:
        digest = hashlib.md5(f"{self.namespace}/{self.name}".encode()).hexdigest()
        return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def api_object(self, node: str) -> dict:
        statuses = []
        for c in self.containers:
            status = {"name": c.name, "containerID": f"containerd://{c.cid(self)}", "restartCount": c.restarts}
            if c.restarts:
                old = container_id(self.namespace, self.name, c.name, str(c.restarts - 1))
                status["lastState"] = {"terminated": {"containerID": f"containerd://{old}", "exitCode": 1}}
            statuses.append(status)
        return {"metadata": {"namespace": self.namespace, "name": self.name, "uid": self.uid},
                "spec": {"nodeName": node, "containers": [{"name": c.name} for c in self.containers]},
                "status": {"phase": "Running", "containerStatuses": statuses}}

    def pod_resources(self) -> pb.PodResources:
        return pb.PodResources(namespace=self.namespace, name=self.name, containers=[
            fakepodresources.gpu_container(c.name, c.card, c.first, c.shares) if c.card is not None
            else pb.ContainerResources(name=c.name) for c in self.containers])


class FakeNode:
    """Writes the pods' processes into a /proc tree and the cards' NVML usage into a FakeDevices."""

    def __init__(self, proc_root: str, devices: nvml.FakeDevices) -> None:
        self.proc_root = proc_root
        self.devices = devices
        self.pods: list[Pod] = []
        self.loose: dict[int, list[tuple[int, int, str]]] = {}  # card -> (pid, MiB, cgroup file text)
        self.utilization: dict[int, int] = {}

    def write_proc(self, pid: int, cgroup: str) -> None:
        folder = os.path.join(self.proc_root, str(pid))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "cgroup"), "w") as f:
            f.write(cgroup)

    def sync(self) -> None:
        """Make /proc and NVML show the pods' processes (and the loose ones) as they are now."""
        for name in os.listdir(self.proc_root):
            for entry in os.listdir(os.path.join(self.proc_root, name)):
                os.unlink(os.path.join(self.proc_root, name, entry))
            os.rmdir(os.path.join(self.proc_root, name))
        per_card: dict[int, list[nvml.Process]] = {}
        for pod in self.pods:
            for c in pod.containers:
                for pid, mib, *sm in c.processes:
                    self.write_proc(pid, LAYOUTS[pod.layout](pod.uid, c.cid(pod)))
                    per_card.setdefault(c.card, []).append(nvml.Process(pid, mib * MIB, float(sm[0]) if sm else 0.0))
        for card, procs in self.loose.items():
            for pid, mib, cgroup in procs:
                self.write_proc(pid, cgroup)
                per_card.setdefault(card, []).append(nvml.Process(pid, mib * MIB, 0.0))
        for card in self.devices.cards():
            procs = tuple(sorted(per_card.get(card.index, []), key=lambda p: p.pid))
            self.devices.set_usage(card.uuid, nvml.Usage(
                memory_used_bytes=sum(p.used_bytes for p in procs), memory_total_bytes=card.memory_mib * MIB,
                utilization_percent=self.utilization.get(card.index, 0), processes=procs,
                process_utilization=True))

    def pod_resources(self) -> list[pb.PodResources]:
        return [p.pod_resources() for p in self.pods]
