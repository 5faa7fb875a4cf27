"""Which container a GPU process belongs to: its cgroup names the pod UID and the container ID.

NVML lists the processes on each card by host PID (the driver knows no PID namespace). The
kubelet puts every container in a cgroup whose path holds the pod's UID and the runtime's
container ID, in every layout in use:

- cgroupfs driver (v1 and v2): ``/kubepods/burstable/pod<uid>/<id>``
- systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/``
  ``cri-containerd-<id>.scope`` (CRI-O: ``crio-<id>.scope``; Docker: ``docker-<id>.scope``)
- containerd's own notation, seen in nested clusters: ``.../kubepods-besteffort-pod<uid>.slice:cri-containerd:<id>``

Read through a private cgroup namespace the path may start with ``/../..``; only the pod and
container parts matter. The root of the /proc tree is configurable, so the agent can read the
host's /proc mounted elsewhere, and tests a tree of files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_POD = re.compile(rf"(?:^|[/-])pod({_UID})(?:\.slice)?(?=$|[/:])")
_CONTAINER = re.compile(r"(?:^|[-:])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class ContainerRef:
    """A container as its cgroup names it: the pod's UID (with dashes) and the runtime's container ID."""

    pod_uid: str
    container_id: str | None  # None: the process sits in the pod's cgroup but in no container's


def parse_cgroup_path(path: str) -> ContainerRef | None:
    """The pod and container a cgroup path belongs to, or None when it is no pod's."""
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):
        # containerd's "slice:runtime:id" notation puts both in one component.
        pod = _POD.search(parts[i].split(":", 1)[0])
        if pod is None:
            continue
        uid = pod.group(1).replace("_", "-")
        for later in parts[i:]:
            if "conmon" in later:  # CRI-O's monitor process, not the container
                return None
            match = _CONTAINER.search(later if later is not parts[i] else later.partition(":")[2])
            if match:
                return ContainerRef(uid, match.group(1))
        return ContainerRef(uid, None)
    return None


def parse_cgroup_file(text: str) -> ContainerRef | None:
    """The container of a /proc/<pid>/cgroup file, cgroup v1 or v2 (the unified line wins)."""
    found = None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        _controllers, _, path = rest.partition(":")
        ref = parse_cgroup_path(path.strip())
        if ref is None:
            continue
        if hierarchy == "0":
            return ref
        if found is None or (found.container_id is None and ref.container_id is not None):
            found = ref
    return found


class ProcReader:
    """Reads processes' cgroups under a /proc root (the host's, when mounted elsewhere)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def container_of(self, pid: int) -> ContainerRef | None:
        """The container of host PID ``pid``, or None when it has exited or belongs to no pod."""
        try:
            with open(os.path.join(self.root, str(int(pid)), "cgroup"), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:  # exited between NVML's list and now, or not visible to us
            return None
        return parse_cgroup_file(text)
