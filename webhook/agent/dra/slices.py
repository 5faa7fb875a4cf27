"""The node's ResourceSlice (resource.k8s.io/v1), kept equal to its healthy cards.

A card that turns Unhealthy or disappears leaves the slice (the pool's generation goes up), so
the scheduler stops placing claims on it; one that recovers comes back. Removal works on every
cluster with DRA, where device taints are beta in 1.36 and halve the slice's device limit.
Claims already prepared on a card that leaves keep running, as with the device plugin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import cast

import kubernetes

from webhook.core import draobjects, names
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

GROUP, VERSION = names.DRA_API_VERSION.split("/")
SLICES = "resourceslices"


class SliceError(ValueError):
    """A slice the API server would refuse; gpushard never sends one."""


class SlicePublisher:
    """Creates or replaces the node's one slice whenever the published cards change; retries until taken."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str,
                 cards: Callable[[], list[draobjects.CardFacts]], shares_per_card: int,
                 driver: str = names.DRA_DRIVER, retry: float = 5.0, timeout: float = 10.0,
                 resync: float = 60.0) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.node = node
        self.driver = driver
        self.shares_per_card = shares_per_card
        self._cards = cards
        self.retry = retry
        self.timeout = timeout
        # The kubelet deletes a driver's slices some time after its plugin unregisters (an agent restart, a
        # kubelet that lost it): look again now and then, not only when the cards change.
        self.resync = resync
        self.name = draobjects.slice_name(node, driver)
        self._dirty = threading.Event()
        self._dirty.set()
        self.published: dict | None = None  # the spec the API server last took

    def changed(self) -> None:
        """Ask for a new slice; cheap, called from the health watcher."""
        self._dirty.set()

    def desired(self, generation: int) -> dict:
        obj = draobjects.resource_slice(self.node, self._cards(), self.shares_per_card, generation, self.driver)
        problems = draobjects.check_slice(obj)
        if problems:
            raise SliceError(f"gpushard: the ResourceSlice for node {self.node!r} breaks the API's rules: "
                             + "; ".join(problems))
        return obj

    def _current(self) -> dict | None:
        try:
            return cast(dict, self.custom.get_cluster_custom_object(GROUP, VERSION, SLICES, self.name,
                                                                    _request_timeout=self.timeout))
        except kubernetes.client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def publish_once(self) -> bool:
        """True once the API server holds the slice we want (or nothing needed doing)."""
        try:
            current = self._current()
            if current is None:
                obj = self.desired(0)
                self.custom.create_cluster_custom_object(GROUP, VERSION, SLICES, obj, _request_timeout=self.timeout)
            else:
                pool = (current.get("spec") or {}).get("pool") or {}
                generation = int(pool.get("generation") or 0)
                obj = self.desired(generation)
                if _same_devices(current, obj):
                    self.published = current["spec"]
                    return True
                obj = self.desired(generation + 1)
                obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.custom.replace_cluster_custom_object(GROUP, VERSION, SLICES, self.name, obj,
                                                          _request_timeout=self.timeout)
        except SliceError as exc:
            log.error("%s", exc)
            return True  # sending it again would not change the answer
        except Exception as exc:  # the API server may be away for a while; the agent must keep serving
            log.warning("gpushard: cannot publish ResourceSlice %r (will retry): %s", self.name,
                        connecting.failure_text(exc))
            return False
        self.published = obj["spec"]
        log.info("gpushard: published ResourceSlice %r with %d card(s), pool generation %d", self.name,
                 len(obj["spec"]["devices"]), obj["spec"]["pool"]["generation"])
        return True

    def run(self, stop: threading.Event) -> None:
        last = time.monotonic()
        while True:
            self._dirty.wait(min(1.0, self.resync))
            if stop.is_set():
                return
            if time.monotonic() - last >= self.resync:
                self._dirty.set()
            if not self._dirty.is_set():
                continue
            last = time.monotonic()
            self._dirty.clear()
            if not self.publish_once():
                self._dirty.set()
                stop.wait(self.retry)


def _same_devices(current: dict, wanted: dict) -> bool:
    have, want = current.get("spec") or {}, wanted["spec"]
    return (have.get("devices") or []) == want["devices"] and have.get("driver") == want["driver"] and \
        have.get("nodeName") == want["nodeName"] and (have.get("pool") or {}).get("name") == want["pool"]["name"]

