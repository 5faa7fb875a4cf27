"""The agent's inventory on its own Node (annotation and label), so the webhook and people can see it."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable

import kubernetes

from webhook import connecting
from webhook.agent import nvml
from webhook.core import names

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


def inventory_json(cards: Iterable[nvml.Card]) -> str:
    """The annotation's value: a JSON list of cards with the camelCase keys Kubernetes users expect."""
    return json.dumps([{"index": c.index, "uuid": c.uuid, "model": c.model, "memoryMiB": c.memory_mib}
                       for c in sorted(cards, key=lambda c: c.index)], separators=(",", ":"))


def node_patch(cards: Iterable[nvml.Card]) -> dict:
    """A merge patch that sets only our annotation and label and leaves the rest of the Node alone."""
    cards = list(cards)
    return {"metadata": {"annotations": {names.INVENTORY_ANNOTATION: inventory_json(cards)},
                         "labels": {names.CARDS_LABEL: str(len(cards))}}}


def api_client() -> kubernetes.client.ApiClient:
    """A client from the one kubeconfig loader (kubectl's order): in a pod, with no kubeconfig
    around, the in-cluster service account."""
    return connecting.client().api


class Publisher:
    """Patches the Node whenever the present cards change, retrying until the API server takes it."""

    def __init__(self, api: kubernetes.client.ApiClient, node_name: str, cards: Callable[[], list[nvml.Card]],
                 retry: float = 5.0, timeout: float = 10.0) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.node_name = node_name
        self._cards = cards
        self.retry = retry
        self.timeout = timeout
        self._dirty = threading.Event()
        self._dirty.set()
        self.published: dict | None = None

    def changed(self) -> None:
        """Ask for a new patch; cheap, called from the health watcher."""
        self._dirty.set()

    def publish_once(self) -> bool:
        patch = node_patch(self._cards())
        if patch == self.published:
            return True
        try:
            self.core.patch_node(self.node_name, patch, _content_type=MERGE_PATCH, _request_timeout=self.timeout)
        except Exception as exc:  # the API server may be away for a while; the agent must keep serving
            log.warning("gpushard: cannot publish the inventory on node %r (will retry): %s",
                        self.node_name, _short(exc))
            return False
        self.published = patch
        log.info("gpushard: published %s cards on node %r", patch["metadata"]["labels"][names.CARDS_LABEL],
                 self.node_name)
        return True

    def run(self, stop: threading.Event) -> None:
        while True:
            self._dirty.wait(1.0)
            if stop.is_set():
                return
            if not self._dirty.is_set():
                continue
            self._dirty.clear()
            if not self.publish_once():
                self._dirty.set()
                stop.wait(self.retry)


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    return f"HTTP {status} {reason}" if status else str(exc)
