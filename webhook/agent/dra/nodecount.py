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
cordon watch) says when the count is gone or changed, and the count is written again.

A node that ran the device-plugin backend before: its kubelet's device manager still counts gpushard.io/gpu
as a device plugin's for five minutes after that plugin stopped (``endpointStopGracePeriod``; again after a
kubelet restart, from its checkpoint), writing its own capacity and allocatable (0) at every status update,
and fails a pod asking it. Writing the count then would only race the kubelet and let the scheduler bind
pods the kubelet refuses. So while the device manager's checkpoint (``kubelet_internal_checkpoint`` in the
device-plugin folder, which the kubelet rewrites when it lets go) lists the resource among its registered
devices, the agent waits, and pods asking it stay Pending; then the kubelet zeroes it once and the agent
writes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import kubernetes

from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
RETRY_S = (1.0, 30.0)
HELD_POLL_S = 5.0  # how often the kubelet's checkpoint is read again while it holds the resource
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"  # the device manager's, in the device-plugin folder
SAY_AGAIN_S = 300.0  # a count the status keeps losing is said at most this often


def device_plugin_holds(checkpoint: str, resource: str) -> bool:
    """Whether the kubelet's device manager counts ``resource`` as a device plugin's: its checkpoint
    (``{"Data": {"RegisteredDevices": {name: [IDs]}}, ...}``) lists it. No file, or one not of that shape:
    no (the count is written, as on a node that never ran a device plugin of that name)."""
    try:
        with open(checkpoint) as source:
            data = json.load(source)
    except (OSError, ValueError):
        return False
    registered = ((data.get("Data") or {}) if isinstance(data, dict) else {}).get("RegisteredDevices")
    return isinstance(registered, dict) and resource in registered


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
                 retry: tuple[float, float] = RETRY_S, timeout: float = 10.0, device_plugin_dir: str | None = None,
                 held_poll: float = HELD_POLL_S) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.node = node
        self.resource = resource
        self.count = count
        self.retry = retry
        self.timeout = timeout
        self.checkpoint = os.path.join(device_plugin_dir, KUBELET_CHECKPOINT) if device_plugin_dir else None
        self.held_poll = held_poll
        self.writes = 0  # the patches the API server took
        self.held = False  # waiting for the kubelet to let go of a device plugin of the same name
        self.held_polls = 0  # the looks at the kubelet's checkpoint that found the resource still held
        self._said_at: float | None = None
        self._dirty = threading.Event()
        self._dirty.set()
        self._said = ""  # the last failure logged, so a lasting one is said once

    def seen(self, node: dict | None) -> None:
        """The Node as last read or watched (None: gone): write again where its count is not ours."""
        if node is None:
            return  # a Node deleted: the kubelet registers it anew, and the watch sees that one
        if advertised(node, self.resource) != (str(self.count), str(self.count)):
            self._dirty.set()

    def _kubelet_holds(self) -> bool:
        held = self.checkpoint is not None and device_plugin_holds(self.checkpoint, self.resource)
        if held and not self.held:
            log.warning("gpushard: the kubelet still counts %s as a device plugin's (%s lists it: that plugin "
                        "stopped within five minutes, or the kubelet restarted since); pods asking it wait Pending "
                        "until the kubelet lets go of it, five minutes after that plugin stopped, and then "
                        "%s=%d goes into node %r's status", self.resource, self.checkpoint, self.resource,
                        self.count, self.node)
        elif self.held and not held:
            log.info("gpushard: the kubelet no longer counts %s as a device plugin's", self.resource)
        self.held = held
        return held

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
        now = time.monotonic()
        if self.writes == 1:
            log.info("gpushard: published %s at node %r's status: %d", self.resource, self.node, self.count)
        elif self._said_at is None or now - self._said_at >= SAY_AGAIN_S:
            log.info("gpushard: the status of node %r lacked %s=%d; written again (%d writes so far)", self.node,
                     self.resource, self.count, self.writes)
        else:
            return True
        self._said_at = now
        return True

    def run(self, stop: threading.Event) -> None:
        delay = self.retry[0]
        while not stop.is_set():
            if not self._dirty.wait(1.0):
                continue
            if stop.is_set():
                return
            if self._kubelet_holds():
                self.held_polls += 1
                stop.wait(self.held_poll)
                continue
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

    @property
    def due(self) -> bool:
        """Whether a write is due (the count not written yet, or seen changed since)."""
        return self._dirty.is_set()
