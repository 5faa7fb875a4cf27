"""Backend dra's count of shares, kept in the agent's own Node's status rather than served by a device plugin.

Under backend dra a pod still asks ``gpushard.io/gpu`` (what a ResourceQuota caps and the scheduler sums), but
its card comes from its claim. Served by a device plugin, that count is admitted by the kubelet's device
manager, which fails every pod asking it ("no healthy devices present") whenever the kubelet admits the
node's pods before the plugin registered: each reboot, and an agent that restarts while the kubelet does.
An extended resource that the Node's status advertises and no device plugin serves, the kubelet admits
against the Node's allocatable alone, and keeps in the status it writes; the kubelet's DRA manager then
waits for the agent to prepare the claim, retrying, instead of failing the pod.

So the agent merge-patches ``status.capacity`` and ``status.allocatable`` of its Node (``nodes/status``)
with the node's whole count: its cards times the shares per card. The count never drops for a card's
health or cordon: the ResourceSlice already keeps the scheduler off such a card, and a count lowered under
pods that hold it would leave those pods over the allocatable. The Node as the agent follows it (the
cordon watch) says when the count is gone or changed (the kubelet zeroes it once when it drops a device
plugin of that name, see docs/dra.md), and the count is written again.
"""

from __future__ import annotations

import logging
import threading

import kubernetes

from webhook import connecting

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
RETRY_S = (1.0, 30.0)


def status_patch(resource: str, count: int) -> dict:
    """The merge patch that sets one extended resource's capacity and allocatable and nothing else."""
    value = str(count)
    return {"status": {"capacity": {resource: value}, "allocatable": {resource: value}}}


def advertised(node: dict | None, resource: str) -> tuple[object, object]:
    """(capacity, allocatable) of ``resource`` in a Node as the API server sent it (None where absent)."""
    status = (node or {}).get("status") or {}
    return ((status.get("capacity") or {}).get(resource), (status.get("allocatable") or {}).get(resource))


class Keeper:
    """Writes the count into the Node's status at start, and again whenever the Node, as seen, lacks it."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, resource: str, count: int,
                 retry: tuple[float, float] = RETRY_S, timeout: float = 10.0) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.node = node
        self.resource = resource
        self.count = count
        self.retry = retry
        self.timeout = timeout
        self.writes = 0  # the patches the API server took
        self._dirty = threading.Event()
        self._dirty.set()
        self._said = ""  # the last failure logged, so a lasting one is said once

    def seen(self, node: dict | None) -> None:
        """The Node as last read or watched (None: gone): write again where its count is not ours."""
        if node is None:
            return  # a Node deleted: the kubelet registers it anew, and the watch sees that one
        if advertised(node, self.resource) != (str(self.count), str(self.count)):
            self._dirty.set()

    def write_once(self) -> bool:
        try:
            self.core.patch_node_status(self.node, status_patch(self.resource, self.count),
                                        _content_type=MERGE_PATCH, _request_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the API server may be away a while; the agent keeps serving
            said = connecting.failure_text(exc)
            if said != self._said:
                hint = (" (the agent's ClusterRole needs patch on nodes/status: deploy/overlays/dra grants it)"
                        if getattr(exc, "status", None) == 403 else "")
                log.warning("gpushard: cannot write %s=%d into the status of node %r: %s%s; pods asking it "
                            "stay Pending until it is there; retrying", self.resource, self.count, self.node,
                            said, hint)
                self._said = said
            return False
        self.writes += 1
        self._said = ""
        if self.writes == 1:
            log.info("gpushard: published %s at node %r's status: %d", self.resource, self.node, self.count)
        else:
            log.info("gpushard: the status of node %r lacked %s=%d; written again", self.node, self.resource,
                     self.count)
        return True

    def run(self, stop: threading.Event) -> None:
        delay = self.retry[0]
        while not stop.is_set():
            if not self._dirty.wait(1.0):
                continue
            if stop.is_set():
                return
            self._dirty.clear()
            if self.write_once():
                delay = self.retry[0]
                continue
            self._dirty.set()
            stop.wait(delay)
            delay = min(delay * 2, self.retry[1])

    def changed(self) -> None:
        """Write again now (a caller that knows the status changed)."""
        self._dirty.set()
