"""The agent's inventory on its own Node (annotation and label), so the webhook and people can see it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

import kubernetes

from webhook.agent.node import nvml
from webhook.core import names, objects
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


def _entry(card: nvml.Card, **extra: object) -> dict:
    return objects.inventory_entry(card.index, card.uuid, card.model, card.memory_mib, **extra)


def inventory_json(cards: Iterable[nvml.Card], details: Mapping | None = None) -> str:
    """The annotation's value: a JSON list of cards with the camelCase keys Kubernetes users expect.

    ``details`` adds, per card index, what isolation the card gives (``cards``), and lists the cards
    left out with the reason (``excluded``: entries with an ``excluded`` key, which readers skip).
    """
    details = details or {}
    extra = details.get("cards") or {}
    listed = [_entry(c, **extra.get(c.index, {})) for c in cards]
    listed += [_entry(c, excluded=reason) for c, reason in details.get("excluded") or ()]
    return objects.write_inventory(listed)


def memory_labels(cards: Iterable[nvml.Card]) -> dict[str, str]:
    """Each card's memory in MiB as a node label (gpushard.io/card-<k>.memory-mib), which a memory
    ask's required node affinity matches."""
    return {names.card_memory_label(c.index): str(c.memory_mib) for c in cards if c.memory_mib > 0}


def node_patch(cards: Iterable[nvml.Card], details: Mapping | None = None, stale: Iterable[str] = ()) -> dict:
    """A merge patch that sets only our annotation and labels and leaves the rest of the Node alone.

    ``stale``: card-memory label keys on the Node now; those of cards no longer present are removed
    (null in a merge patch), so no pod is sized for a card that is gone.
    """
    cards = list(cards)
    labels: dict[str, str | None] = {names.CARDS_LABEL: str(len(cards))}
    current = memory_labels(cards)
    labels.update({key: None for key in sorted(stale) if key not in current})
    labels.update(current)
    return {"metadata": {"annotations": {names.INVENTORY_ANNOTATION: inventory_json(cards, details)},
                         "labels": labels}}


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
        # Set by the agent: per-card isolation and the cards it left out, for the same annotation.
        self.details: Callable[[], Mapping] | None = None

    def changed(self) -> None:
        """Ask for a new patch; cheap, called from the health watcher."""
        self._dirty.set()

    def _labels_on_node(self) -> set[str]:
        """Our card-memory label keys on the Node: those we last published, or, before that, those
        the Node has (an agent that restarts after a card left must remove that card's label)."""
        if self.published is not None:
            return {k for k, v in self.published["metadata"]["labels"].items()
                    if v is not None and names.card_memory_index(k) is not None}
        try:
            # A list of the one Node by name: what RBAC grants as list on nodes.
            listed = self.core.list_node(field_selector=f"metadata.name={self.node_name}",
                                         _request_timeout=self.timeout)
        except Exception:  # the patch below says what went wrong, and the next try reads again
            return set()
        keys: set[str] = set()
        for node in listed.items or ():
            labels = (node.metadata.labels if node.metadata is not None else None) or {}
            keys |= {k for k in labels if names.card_memory_index(k) is not None}
        return keys

    def publish_once(self) -> bool:
        patch = node_patch(self._cards(), self.details() if self.details is not None else None,
                           self._labels_on_node())
        if patch == self.published:
            return True
        try:
            self.core.patch_node(self.node_name, patch, _content_type=MERGE_PATCH, _request_timeout=self.timeout)
        except Exception as exc:  # the API server may be away for a while; the agent must keep serving
            log.warning("gpushard: cannot publish the inventory on node %r (will retry): %s",
                        self.node_name, connecting.failure_text(exc))
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

