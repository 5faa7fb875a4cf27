"""The startup taint the agent lifts once its Node advertises the cards, for autoscalers.

A node an autoscaler adds turns Ready before its device plugins registered. cluster-autoscaler then sees
a Ready node without the resources the pending pods asked, and may add a second node for the same pods.
Its answer is a startup taint: a taint whose key starts with ``startup-taint.cluster-autoscaler.kubernetes.io/``
marks a node as still starting, and whoever registers the resources removes it. Karpenter's NodePool
``startupTaints`` work the same way. The node group (or NodePool) creates its nodes with
``startup-taint.cluster-autoscaler.kubernetes.io/gpushard:NoSchedule``; the agent tolerates it, and
removes it once the Node's allocatable shows every resource the agent serves for its offered cards
(healthy, present, not cordoned). It removes no other taint: another startup taint is another component's.

The agent follows its Node with the cordon watch (``cordonwatching``), which hands every version of the
Node here. The removal is a JSON patch that first tests the Node's resourceVersion, so a taint someone
added meanwhile is never dropped; a failed patch is tried again with the next version of the Node or
after ``retry`` seconds. The own-node policy (deploy/base/agent-node-restriction.yaml) lets the agent
remove this one taint and change nothing else of the spec.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import kubernetes

from webhook.core import names, objects
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

JSON_PATCH = "application/json-patch+json"


def missing(node: dict, wanted: list[str]) -> list[str]:
    """The resources of ``wanted`` the Node's allocatable does not show yet (absent or zero)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return [name for name in wanted if str(allocatable.get(name, "0")).strip() in ("", "0")]


def tainted(node: dict) -> bool:
    return any((t or {}).get("key") == names.STARTUP_TAINT for t in (node.get("spec") or {}).get("taints") or ())


def lift_patch(node: dict) -> list[dict]:
    """The JSON patch that removes gpushard's startup taint, if the Node is still the version read."""
    taints = (node.get("spec") or {}).get("taints") or []
    kept = [t for t in taints if (t or {}).get("key") != names.STARTUP_TAINT]
    version = objects.meta(node).get("resourceVersion")
    patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": version}] if version else []
    return patch + [{"op": "replace", "path": "/spec/taints", "value": kept} if kept
                    else {"op": "remove", "path": "/spec/taints"}]


class Lifter:
    """Removes gpushard's startup taint from the agent's Node once the Node advertises ``wanted()``."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, wanted: Callable[[], list[str]],
                 retry: float = 5.0, timeout: float = 10.0) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.node = node
        self.wanted = wanted
        self.retry = retry
        self.timeout = timeout
        self._latest: dict | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._said: tuple[str, ...] | None = None  # the missing resources last logged
        self.lifted = False

    def seen(self, node: dict | None) -> None:
        """Take the Node as last read or watched (None: deleted); cheap, called from the watch's thread."""
        with self._lock:
            self._latest = node
        self._wake.set()

    def changed(self) -> None:
        """The offered cards changed (health, cordon): judge the last Node again."""
        self._wake.set()

    def try_once(self) -> bool:
        """Lift the taint if it is there and the cards are advertised; False when a patch failed."""
        with self._lock:
            node = self._latest
        if node is None or not tainted(node):
            return True
        waiting = missing(node, self.wanted())
        if waiting:
            if tuple(waiting) != self._said:
                self._said = tuple(waiting)
                log.info("gpushard: node %r keeps its startup taint %s until it advertises %s", self.node,
                         names.STARTUP_TAINT, ", ".join(waiting))
            return True
        try:
            self.core.patch_node(self.node, lift_patch(node), _content_type=JSON_PATCH,
                                 _request_timeout=self.timeout)
        except Exception as exc:  # a newer Node (409/422 on the test) or an API server away: try again
            log.warning("gpushard: cannot remove the startup taint %s from node %r (will retry): %s",
                        names.STARTUP_TAINT, self.node, connecting.failure_text(exc))
            return False
        self.lifted = True
        log.info("gpushard: node %r advertises its cards; startup taint %s removed", self.node, names.STARTUP_TAINT)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self._wake.wait(1.0):
                continue
            self._wake.clear()
            if stop.is_set():
                return
            if not self.try_once():
                self._wake.set()
                stop.wait(self.retry)

