"""The cards an operator cordoned, followed on the agent's own Node, so that it stops offering their shares.

`gpushard cordon NODE CARD` writes the annotation gpushard.io/card-<k>.cordoned on the Node; the
agent only reads it (the own-node policy refuses the agent any change to it). The agent follows its
Node by name with the one list-and-watch loop (``kubeapi.informing``: lists again on 410 Gone, backs
off after any failure up to 30 s) and keeps the set of cordoned card indexes. On each change it calls
``on_change``: the card-k device plugin then lists no device for the card (backend deviceplugin) and
the ResourceSlice leaves it out (backend dra). Pods on the card keep it: nothing here touches them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import kubernetes

from webhook.core import objects
from webhook.kubeapi import informing

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
CONNECT_TIMEOUT_S = 10.0
BACKOFF_S = (1.0, 30.0)


class Watcher:
    """Lists then watches one Node, keeping which of its cards an operator cordoned."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, watch_timeout: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = BACKOFF_S, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._api = api
        self._core = kubernetes.client.CoreV1Api(api)
        self.node = node
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.timeout = timeout
        self.on_change: Callable[[], None] | None = None
        # Given every Node as read or watched (None: deleted), whatever changed on it (backend dra's count).
        self.on_node: Callable[[dict | None], None] | None = None
        self.read = False  # the Node was read at least once
        self._cordons: dict[int, objects.Cordon] = {}
        self._lock = threading.Lock()
        self._informer: informing.Informer | None = None
        self._closed = False

    @property
    def cordoned(self) -> frozenset[int]:
        """The card indexes cordoned now (none before the Node was read: the cards stay offered)."""
        with self._lock:
            return frozenset(self._cordons)

    def cordons(self) -> Mapping[int, objects.Cordon]:
        with self._lock:
            return dict(self._cordons)

    def apply(self, node: dict | None) -> bool:
        """Take the cordons of a Node as the API server sent it (None: the Node is gone); True on a change."""
        if self.on_node is not None:
            self.on_node(node)
        found = objects.read_cordons(objects.meta(node or {}).get("annotations"))
        with self._lock:
            self.read = True
            if found == self._cordons:
                return False
            before, self._cordons = self._cordons, found
        for index in sorted(set(found) - set(before)):
            log.warning("gpushard: card %d of node %r is cordoned (%s): its shares are no longer offered; pods on "
                        "it keep running", index, self.node, found[index].said())
        for index in sorted(set(before) - set(found)):
            log.info("gpushard: card %d of node %r is uncordoned: its shares are offered again", index, self.node)
        if self.on_change is not None:
            self.on_change()
        return True

    # --- a sink of the informer ------------------------------------------------------------------

    def reduce(self, resource: str, items, into: dict) -> dict:
        for node in items:
            if objects.meta(node).get("name") == self.node:
                into[self.node] = node
        return into

    def apply_list(self, resource: str, fresh: dict) -> None:
        self.apply(fresh.get(self.node))

    def apply_event(self, resource: str, kind: str, obj: dict) -> None:
        if objects.meta(obj).get("name") == self.node:
            self.apply(None if kind == "DELETED" else obj)

    def watch_opened(self, resource: str) -> None:
        return None

    def watch_closed(self, resource: str, gap: bool) -> None:
        return None

    # --- the loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """List, then watch, until ``stop`` is set or ``close`` is called."""
        informer = informing.Informer(
            self._api, self, resources=(informing.NODES,), watch_timeout=self.watch_timeout, backoff=self.backoff,
            connect_timeout=self.timeout, stop=stop,
            calls={informing.NODES: lambda **kw: self._core.list_node(field_selector=f"metadata.name={self.node}",
                                                                       **kw)},
            meanwhile=f"the cordons of node {self.node!r} stay as last read; the agent's ClusterRole needs list "
                      "and watch on nodes")
        with self._lock:
            if self._closed:
                return
            self._informer = informer
        informer.run(informing.NODES)

    def close(self) -> None:
        """End the loop now, cutting an open watch (this sets the loop's ``stop``)."""
        with self._lock:
            self._closed = True
            informer = self._informer
        if informer is not None:
            informer.close()
