"""The names of the containers on this node by container ID, from the API's list of the node's pods.

The kubelet's PodResources API names each container that holds devices, but not its pod's UID
nor its container ID, which are all a process's cgroup gives. The pods' status does map
container IDs to names, so the agent lists the pods bound to its node (``spec.nodeName``) and
keeps the index until a process names a container it has not seen (a new pod, a restart).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kubernetes

from webhook.core import asks as req
from webhook.core import findings, objects
from webhook.core import policy as policy_mod

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 5.0  # at most one list per this long, however many unknown containers a scrape finds
MAX_AGE_S = 60.0  # and one at least this often, so that deleted pods leave the index
TIMEOUT_S = 5.0  # inside a scrape: stay well under Prometheus's default 10 s scrape timeout


@dataclass(frozen=True)
class ContainerName:
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class PodName:
    namespace: str
    pod: str
    containers: tuple[str, ...]
    memory_asked_mib: int = 0  # a pod placed by its memory ask: what it asked (gpushard.io/memory-mib)
    # Each container's gpushard.io/gpu as its spec asks it (read with a policy only): (name, shares) pairs.
    asked: tuple[tuple[str, int], ...] = ()

    @property
    def shares(self) -> dict[str, int]:
        return dict(self.asked)


def strip_runtime(container_id: str) -> str:
    """``containerd://abc`` -> ``abc``: the status names the runtime, the cgroup does not."""
    return container_id.partition("://")[2] or container_id


def asked_shares(pod: dict, policy: policy_mod.Policy) -> tuple[tuple[str, int], ...]:
    """Each container's shares as the pod's spec asks them (a spec gpushard could not read: none)."""
    try:
        asks = req.read_spec(objects.mapping(pod.get("spec")), policy)
    except findings.ObjectError:
        return ()
    return tuple((a.name, a.shares) for a in asks if a.shares > 0 and not a.passthrough)


def index_pods(items: list[dict], policy: policy_mod.Policy | None = None
               ) -> tuple[dict[str, ContainerName], dict[str, PodName]]:
    """(container ID -> names, pod UID -> pod) from a pod list's items; odd items are skipped. With a
    ``policy``, each pod's containers' asked shares too (backend dra's metrics)."""
    by_id: dict[str, ContainerName] = {}
    by_uid: dict[str, PodName] = {}
    for pod in items:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        namespace, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
        if not (isinstance(namespace, str) and isinstance(name, str)):
            continue
        containers = []
        for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            for entry in status.get(key) or []:
                cname = entry.get("name")
                if not isinstance(cname, str):
                    continue
                containers.append(cname)
                # The previous instance's processes may linger for a moment after a restart.
                ids = [entry.get("containerID"), ((entry.get("lastState") or {}).get("terminated") or {})
                       .get("containerID")]
                for cid in ids:
                    if isinstance(cid, str) and cid:
                        by_id[strip_runtime(cid)] = ContainerName(namespace, name, cname)
        if isinstance(uid, str):
            by_uid[uid] = PodName(namespace, name, tuple(containers), objects.memory_asked_mib(pod),
                                  asked_shares(pod, policy) if policy is not None else ())
    return by_id, by_uid


class NodePods:
    """The node's pods, listed again when asked about an unknown container (rate-limited) or when stale."""

    def __init__(self, api: kubernetes.client.ApiClient, node_name: str, *, min_interval: float = MIN_INTERVAL_S,
                 max_age: float = MAX_AGE_S, timeout: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, policy: policy_mod.Policy | None = None) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.node_name = node_name
        self.policy = policy  # given: each pod's asked shares are read too
        self.min_interval = min_interval
        self.max_age = max_age
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._listed_at: float | None = None
        self._by_id: dict[str, ContainerName] = {}
        self._by_uid: dict[str, PodName] = {}
        self._by_name: dict[tuple[str, str], PodName] = {}
        self.lists = 0
        self.errors = 0

    def _list(self) -> None:
        self._listed_at = self._clock()
        self.lists += 1
        try:
            response: Any = self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node_name}", _preload_content=False,
                _request_timeout=self.timeout)  # the HTTP response, read raw
            try:
                body = json.loads(response.data)
            finally:
                response.release_conn()
        except Exception as exc:  # the API server may be away; keep the last index
            self.errors += 1
            log.warning("gpushard: cannot list the pods on node %r: %s", self.node_name, exc)
            return
        self._by_id, self._by_uid = index_pods(body.get("items") or [], self.policy)
        self._by_name = {(p.namespace, p.pod): p for p in self._by_uid.values()}

    def _fresh(self, unknown: bool = False) -> None:
        """List again when stale, or when the caller asks about something unknown (rate-limited)."""
        now = self._clock()
        age = None if self._listed_at is None else now - self._listed_at
        if age is None or age >= self.max_age or (unknown and age >= self.min_interval):
            self._list()

    def container(self, container_id: str) -> ContainerName | None:
        """Names of the container with this runtime ID, listing the pods again if it is new."""
        with self._lock:
            self._fresh(container_id not in self._by_id)
            return self._by_id.get(container_id)

    def pod(self, uid: str) -> PodName | None:
        """The pod with this UID, as last listed."""
        with self._lock:
            self._fresh()
            return self._by_uid.get(uid)

    def named(self, namespace: str, pod: str) -> PodName | None:
        """The pod of this name, listing the pods again if it is new (a pod the kubelet just admitted)."""
        with self._lock:
            self._fresh((namespace, pod) not in self._by_name)
            return self._by_name.get((namespace, pod))

    def shares(self, namespace: str, pod: str) -> dict[str, int] | None:
        """Each container's asked shares of the pod of this name (None: not listed); needs ``policy``."""
        found = self.named(namespace, pod)
        return found.shares if found is not None else None
