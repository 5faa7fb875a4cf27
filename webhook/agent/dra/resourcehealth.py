"""The DRA health stream the kubelet reads (dra-health/v1alpha1 NodeWatchResources): each card's health.

The kubelet (1.36, ResourceHealthStatus beta) opens ``NodeWatchResources`` on every DRA plugin it
registers and keeps it open; when a stream ends it forgets the driver's health and opens another
5 s later. Each message is the driver's full list. The kubelet keys a device by driver, pool and
device name, the names the claim's allocation (and so the ResourceSlice) gave it, and shows the
device's health in the status of every container whose claim holds it. A device not reported
again within its timeout (ours, or the kubelet's default of 30 s) turns Unknown, so the list is
sent again every ``resend`` seconds even when nothing changed, and at once when a card changes.
(pkg/kubelet/cm/dra/manager.go ``HandleWatchResourcesStream``, healthinfo.go, plugin/dra_plugin_manager.go.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from webhook.agent.node import health, nvml
from webhook.agent.proto import dra_health_pb2 as hpb
from webhook.agent.proto import dra_health_pb2_grpc as hpb_grpc
from webhook.core import draobjects

log = logging.getLogger(__name__)

TIMEOUT_S = 30  # what each device's health_check_timeout_seconds says: the kubelet's DefaultHealthTimeout
RESEND_S = 10.0  # a full list this often, so a late message or two never lets the timeout pass
MAX_MESSAGE = 1024  # the kubelet cuts longer ones (v1.ResourceHealthMessageMaxLength)
# Each open stream holds a worker of the plugin's server for its life; the kubelet keeps one. A cap
# keeps NodePrepareResources answering whoever else opens streams.
MAX_STREAMS = 2


@dataclass(frozen=True)
class DeviceState:
    """One device's health as the stream reports it."""

    pool: str
    device: str
    healthy: bool
    message: str = ""


def card_states(node: str, cards: list[nvml.Card], snapshot: health.Snapshot) -> list[DeviceState]:
    """Every card the agent shares, named as the node's ResourceSlice names it.

    A card that left the slice (an Xid, lost) is still reported, Unhealthy: claims prepared on
    it hold it until their pods go, and the kubelet shows its health in their status.
    """
    found = []
    for card in sorted(cards, key=lambda c: c.index):
        healthy = bool(snapshot.present.get(card.index) and snapshot.healthy.get(card.index))
        message = "" if healthy else _message(card, snapshot.reasons.get(card.index, ""))
        found.append(DeviceState(draobjects.pool_name(node), draobjects.device_name(card.index), healthy, message))
    return found


def _message(card: nvml.Card, reason: str) -> str:
    text = f"gpushard: card {card.index} ({card.uuid}) is Unhealthy" + (f": {reason}" if reason else "")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def response(states: list[DeviceState], now: int, timeout: int = TIMEOUT_S) -> hpb.NodeWatchResourcesResponse:
    return hpb.NodeWatchResourcesResponse(devices=[hpb.DeviceHealth(
        device=hpb.DeviceIdentifier(pool_name=s.pool, device_name=s.device),
        health=hpb.HEALTHY if s.healthy else hpb.UNHEALTHY,
        last_updated_time=now, health_check_timeout_seconds=timeout, message=s.message) for s in states])


class HealthServicer(hpb_grpc.DRAResourceHealthServicer):
    """Streams ``states(snapshot)`` of the board: at once, on every change, and every ``resend`` seconds."""

    def __init__(self, board: health.Board, states: Callable[[health.Snapshot], list[DeviceState]],
                 resend: float = RESEND_S, timeout: int = TIMEOUT_S, max_streams: int = MAX_STREAMS) -> None:
        self.board = board
        self.states = states
        self.resend = resend
        self.timeout = timeout
        self.max_streams = max_streams
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._open = 0

    @property
    def streams(self) -> int:
        """How many streams are open now."""
        with self._lock:
            return self._open

    def stop(self) -> None:
        """End every open stream (with status OK: the kubelet takes that as the plugin going)."""
        self._stopped.set()
        self.board.poke()

    def NodeWatchResources(self, request, context):
        with self._lock:
            full = self._open >= self.max_streams
            if not full:
                self._open += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"gpushard: {self.max_streams} health streams are open already; close one first")
        try:
            yield from self._watch(context)
        finally:
            with self._lock:
                self._open -= 1

    def _watch(self, context: grpc.ServicerContext) -> Iterator[hpb.NodeWatchResourcesResponse]:
        def interrupted() -> bool:
            return self._stopped.is_set() or not context.is_active()

        context.add_callback(self.board.poke)  # a kubelet that hangs up wakes us at once
        seen: int | None = None
        sent: list[DeviceState] | None = None
        last = 0.0
        while not interrupted():
            wait = max(0.0, self.resend - (time.monotonic() - last)) if sent is not None else 0.0
            snapshot = self.board.wait_change(seen, wait, interrupted)
            if snapshot is None:
                if interrupted() or time.monotonic() - last < self.resend:
                    continue
                snapshot = self.board.snapshot()  # nothing changed: the same list again, before the timeout
            if snapshot.closed:
                return
            seen = snapshot.version
            current = self.states(snapshot)
            if current != sent:
                changed = [s for s in current if s not in (sent or [])]
                log.info("gpushard: DRA health: %s", ", ".join(
                    f"{s.device} {'Healthy' if s.healthy else 'Unhealthy'}" for s in changed))
            elif time.monotonic() - last < self.resend:
                continue  # the board moved on something the stream does not report
            sent, last = current, time.monotonic()
            yield response(current, int(time.time()), self.timeout)
