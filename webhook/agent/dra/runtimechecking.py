"""Checking that the node's container runtime applies CDI devices, where the DRA backend needs it to.

The runtime version comes from the agent's own Node (``status.nodeInfo.containerRuntimeVersion``, which the
kubelet reports), read with the list the agent's ClusterRole already grants, every ``interval`` seconds:
a runtime upgraded under a running agent is seen within a minute. The verdict (webhook.core.runtimes)
decides whether the node's ResourceSlice offers cards and whether a claim is prepared; it goes to the log
once per change, the Node's inventory and a metric. Until the first read it is unknown, and the DRA backend
offers nothing: a node never takes a claim before its runtime was checked.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import kubernetes

from webhook.core import runtimes

log = logging.getLogger(__name__)

INTERVAL_S = 60.0
UNREAD = runtimes.CdiSupport("unknown", None, "the node's container runtime has not been read yet")


class Checker:
    """Reads the node's runtime version and keeps the CDI verdict; ``on_change`` hears every new one."""

    def __init__(self, api: kubernetes.client.ApiClient | None, node: str, declared: str = runtimes.AUTO,
                 interval: float = INTERVAL_S, timeout: float = 10.0,
                 read: Callable[[], str] | None = None) -> None:
        self.core = kubernetes.client.CoreV1Api(api) if api is not None else None
        self.node = node
        self.declared = declared
        self.interval = interval
        self.timeout = timeout
        self._read = read or self._read_node
        self.verdict = UNREAD
        self.read_once = False
        self.on_change: Callable[[], None] | None = None

    def _read_node(self) -> str:
        # Raw JSON: the client's typed Node refuses a nodeInfo missing any of its fields, and only one is read.
        assert self.core is not None  # without an API client the caller gives its own read
        answer: Any = self.core.list_node(field_selector=f"metadata.name={self.node}", _preload_content=False,
                                          _request_timeout=self.timeout)  # the HTTP response, read raw
        for item in json.loads(answer.data).get("items") or ():
            version = ((item.get("status") or {}).get("nodeInfo") or {}).get("containerRuntimeVersion")
            return version if isinstance(version, str) else ""
        return ""

    def serves(self) -> bool:
        """Whether claims may be taken: the runtime applies CDI, or gpushard cannot tell (and said so)."""
        return self.read_once and self.verdict.applies is not False

    def check_once(self) -> runtimes.CdiSupport:
        try:
            version = self._read()
        except Exception as exc:  # the API may be away for a while: keep the last verdict
            log.warning("gpushard: cannot read the container runtime of node %r (will retry): %s", self.node, exc)
            return self.verdict
        verdict = runtimes.cdi_support(version, self.declared)
        first = not self.read_once
        self.read_once = True
        if verdict != self.verdict or first:
            if verdict.applies is False:
                log.error("gpushard: node %r: %s (docs/dra.md, \"The container runtime\")", self.node, verdict.reason)
            elif verdict.applies is None:
                log.warning("gpushard: node %r: %s", self.node, verdict.reason)
            else:
                log.info("gpushard: node %r: %s", self.node, verdict.reason)
            self.verdict = verdict
            if self.on_change is not None:
                self.on_change()
        return verdict

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.check_once()
            stop.wait(self.interval)

    def card_details(self) -> dict:
        """What every card's inventory entry says when the node takes no claim: the reason."""
        if self.serves() or not self.read_once:
            return {}
        return {"draRefused": self.verdict.reason}
