"""The cards an operator cordoned, followed on the agent's own Node, so that it stops offering their shares.

`gpushard cordon NODE CARD` writes the annotation gpushard.io/card-<k>.cordoned on the Node; the
agent only reads it (the own-node policy refuses the agent any change to it). The agent lists its
Node by name, then watches it from the list's resourceVersion, lists again on 410 Gone and after
any failure (with backoff: a watch the agent may not make then degrades to a list every 30 s at
most), and keeps the set of cordoned card indexes. On each change it calls ``on_change``: the
card-k device plugin then lists no device for the card (backend deviceplugin) and the ResourceSlice
leaves it out (backend dra). Pods on the card keep it: nothing here touches them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping

import kubernetes

from webhook import connecting
from webhook.core import objects

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
CONNECT_TIMEOUT_S = 10.0
BACKOFF_S = (1.0, 30.0)


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class Watcher:
    """Lists then watches one Node, keeping which of its cards an operator cordoned."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, watch_timeout: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = BACKOFF_S, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
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
        self._response = None  # the open watch, to cut on close()
        self._stop = threading.Event()
        self._said = ""  # the last failure logged, so a lasting one is said once

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

    # --- talking to the API server --------------------------------------------------------------

    def _list(self) -> str:
        response = self.core.list_node(field_selector=f"metadata.name={self.node}", _preload_content=False,
                                       _request_timeout=self.timeout)
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        items = body.get("items") or []
        self.apply(items[0] if items else None)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        response = self.core.list_node(field_selector=f"metadata.name={self.node}", watch=True,
                                       resource_version=version, allow_watch_bookmarks=True,
                                       timeout_seconds=self.watch_timeout, _preload_content=False,
                                       _request_timeout=(self.timeout, self.watch_timeout + 30))
        self._response = response
        try:
            for line in connecting.watch_lines(response, self._stop):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = str(objects.meta(obj).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED"):
                    self.apply(obj)
                elif kind == "DELETED":
                    self.apply(None)
        finally:
            self._response = None
            connecting.finish_watch(response)
        return version

    def run(self, stop: threading.Event) -> None:
        """List, then watch, until ``stop`` (or ``close``)."""
        version: str | None = None
        delay = self.backoff[0]
        while not stop.is_set() and not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                delay = self.backoff[0]
                if self._said:
                    log.info("gpushard: following the cordons of node %r again", self.node)
                    self._said = ""
            except _Gone:
                version = None
            except Exception as exc:  # noqa: BLE001 - any failure: back off, then list again
                if stop.is_set() or self._stop.is_set():
                    return
                version = None
                if getattr(exc, "status", None) == 410:
                    continue
                said = connecting.failure_text(exc)
                if said != self._said:
                    hint = (" (the agent's ClusterRole needs list and watch on nodes)"
                            if getattr(exc, "status", None) == 403 else "")
                    log.warning("gpushard: cannot follow the cordons of node %r: %s%s; retrying, with the cards' "
                                "cordons as last read", self.node, said, hint)
                    self._said = said
                stop.wait(delay)
                delay = min(delay * 2, self.backoff[1])

    def close(self) -> None:
        """End the loop now, cutting an open watch."""
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # wakes the thread blocked reading the stream
            except Exception:  # noqa: BLE001 - already closed: nothing to wake
                pass
