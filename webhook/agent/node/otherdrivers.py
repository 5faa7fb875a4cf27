"""Finding another DRA driver that offers this node's GPUs: a conflict the agent can see and report.

A node must not offer the same cards through gpushard's device plugin and a DRA driver: a pod
whose ResourceClaim the DRA driver prepares gets a card outside every share and every quota.
The agent lists the ResourceSlices (``resource.k8s.io/v1``) published for its own node and
reports a driver as conflicting when it is a known GPU driver, or when one of its devices
carries one of this node's card UUIDs as an attribute (as NVIDIA's DRA driver publishes them).
The finding goes into the Node's inventory annotation, a metric and a log line; it decides
nothing (admission closes the claims, docs/security.md).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import kubernetes

from webhook.agent.node import nvml
from webhook.core import names

log = logging.getLogger(__name__)

# DRA drivers that publish NVIDIA GPUs whole (kubernetes-sigs/dra-driver-nvidia-gpu, formerly
# NVIDIA/k8s-dra-driver-gpu: driver name gpu.nvidia.com).
KNOWN_GPU_DRIVERS = ("gpu.nvidia.com",)
INTERVAL_S = 60.0
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Conflict:
    """One driver publishing GPUs for this node: its slices and devices, and which of our cards it names."""

    driver: str
    slices: tuple[str, ...]
    devices: int
    cards: tuple[int, ...]  # our card indexes its devices name by UUID; empty: known by the driver's name only

    def as_json(self) -> dict:
        return {"driver": self.driver, "slices": list(self.slices), "devices": self.devices, "cards": list(self.cards)}


def _strings(device: dict) -> set[str]:
    """Every string value among a device's attributes (``{"uuid": {"string": "GPU-..."}}``)."""
    found = set()
    for value in (device.get("attributes") or {}).values():
        if isinstance(value, dict) and isinstance(value.get("string"), str):
            found.add(value["string"])
    return found


def conflicts(slices: Iterable[dict], node: str, cards: Iterable[nvml.Card],
              known: Iterable[str] = KNOWN_GPU_DRIVERS) -> list[Conflict]:
    """The drivers among ``slices`` that offer GPUs of ``node``, by driver name, sorted."""
    by_uuid = {c.uuid: c.index for c in cards}
    known = set(known)
    drivers: dict[str, dict] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("nodeName") != node or not isinstance(spec.get("driver"), str):
            continue
        if spec["driver"] == names.DRA_DRIVER:
            continue  # gpushard's own slice (backend dra) offers these cards by design
        devices = [d for d in spec.get("devices") or () if isinstance(d, dict)]
        named = {by_uuid[s] for d in devices for s in _strings(d) if s in by_uuid}
        if spec["driver"] not in known and not named:
            continue
        entry = drivers.setdefault(spec["driver"], {"slices": set(), "devices": 0, "cards": set()})
        entry["slices"].add(str((item.get("metadata") or {}).get("name") or ""))
        entry["devices"] += len(devices)
        entry["cards"] |= named
    return [Conflict(driver, tuple(sorted(e["slices"])), e["devices"], tuple(sorted(e["cards"])))
            for driver, e in sorted(drivers.items())]


class Watcher:
    """Lists the node's ResourceSlices every ``interval`` seconds and keeps what conflicts.

    A cluster that serves no ``resource.k8s.io/v1`` (404) has no DRA driver to conflict with; an
    agent without the right to list ResourceSlices (403) says so once and reports nothing.
    """

    def __init__(self, api: kubernetes.client.ApiClient, node: str, cards: Callable[[], list[nvml.Card]],
                 interval: float = INTERVAL_S, timeout: float = TIMEOUT_S) -> None:
        self.resource = kubernetes.client.ResourceV1Api(api)
        self.node = node
        self._cards = cards
        self.interval = interval
        self.timeout = timeout
        self.found: list[Conflict] = []
        self.checked = False  # a list answered at least once
        self.on_change: Callable[[], None] | None = None
        self._said: set[int] = set()  # HTTP statuses already logged

    def check_once(self) -> list[Conflict]:
        try:
            response: Any = self.resource.list_resource_slice(field_selector=f"spec.nodeName={self.node}",
                                                              _preload_content=False,
                                                              _request_timeout=self.timeout)  # the HTTP response
            items = json.loads(response.data).get("items") or []
        except kubernetes.client.ApiException as exc:
            if exc.status not in self._said:
                self._said.add(exc.status)
                if exc.status == 404:
                    log.info("gpushard: the API serves no resource.k8s.io/v1 ResourceSlices; no DRA driver to "
                             "conflict with")
                else:
                    log.warning("gpushard: cannot list the ResourceSlices of node %r (HTTP %s %s); DRA conflicts "
                                "are not checked (the agent's ClusterRole needs list on resourceslices)",
                                self.node, exc.status, exc.reason)
            return self.found
        except Exception as exc:  # the API may be away for a while: keep the last finding
            log.warning("gpushard: cannot list the ResourceSlices of node %r: %s", self.node, exc)
            return self.found
        found = conflicts(items, self.node, self._cards())
        self.checked = True
        if found != self.found:
            for c in found:
                which = f"cards {list(c.cards)}" if c.cards else "GPUs"
                log.warning("gpushard: DRA driver %s publishes %s of node %r (ResourceSlices %s): a pod claiming "
                            "them gets a card outside every share; remove the driver from shared nodes "
                            "(docs/install.md)", c.driver, which, self.node, ", ".join(c.slices))
            if not found and self.found:
                log.info("gpushard: no DRA driver publishes GPUs of node %r any more", self.node)
            self.found = found
            if self.on_change is not None:
                self.on_change()
        return found

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.check_once()
            stop.wait(self.interval)

    def card_details(self) -> dict[int, dict]:
        """Per card index, what the inventory says of conflicts: the drivers that offer the card too."""
        per_card: dict[int, list[str]] = {}
        everyone = [c.index for c in self._cards()]
        for c in self.found:
            for index in c.cards or everyone:
                per_card.setdefault(index, []).append(c.driver)
        return {index: {"draConflict": drivers} for index, drivers in per_card.items()}
