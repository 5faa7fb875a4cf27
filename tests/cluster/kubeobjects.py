"""Nodes, pods and waits for the live-view tests, as the API server would store them."""

from __future__ import annotations

import json

from tests import polling
from webhook.core import names


def node(name: str, cards: dict[int, int] | None = None, labels: dict | None = None, taints: list | None = None,
         ready: bool = True, unschedulable: bool = False, inventory: list | None = None) -> dict:
    allocatable = {"cpu": "32", "memory": "256Gi"}
    allocatable.update({f"{names.CARD_PREFIX}{k}": str(v) for k, v in (cards or {}).items()})
    meta: dict = {"name": name, "labels": {names.HOSTNAME_LABEL: name, **(labels or {})}}
    if cards or inventory:  # the agent labels the nodes it publishes cards on
        meta["labels"].setdefault(names.CARDS_LABEL, str(len(inventory or cards)))
    if inventory is not None:
        meta["annotations"] = {names.INVENTORY_ANNOTATION: json.dumps(inventory)}
    return {
        "metadata": meta,
        "spec": {"taints": taints or [], **({"unschedulable": True} if unschedulable else {})},
        "status": {"allocatable": allocatable, "conditions": [
            {"type": "MemoryPressure", "status": "False"},
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pod(name: str, card: int, shares: int, node_name: str | None = None, phase: str = "Running",
        namespace: str = "default", extra: dict | None = None) -> dict:
    """A pod as gpushard rewrites it: card-k and shares requested equal to limits."""
    resources = {names.SHARES_RESOURCE: str(shares), f"{names.CARD_PREFIX}{card}": str(shares)}
    spec: dict = {"containers": [{"name": "main", "image": "cuda", "resources": {
        "requests": dict(resources), "limits": dict(resources)}}]}
    if node_name:
        spec["nodeName"] = node_name
    spec.update(extra or {})
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                         "labels": {names.SHARED_LABEL: names.SHARED_LABEL_VALUE}},
            "spec": spec, "status": {"phase": phase}}


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll until predicate() is truthy (tests/polling.py); fail after ``timeout`` seconds."""
    return polling.eventually(predicate, what, timeout)


def used(view, node_name: str, card: int) -> int | None:
    """Shares used on a card of a view (None: no such node or card)."""
    if view is None:
        return None
    for n in view.nodes:
        if n.name == node_name:
            for c in n.cards:
                if c.index == card:
                    return c.used
    return None
