"""The cards' live state, shared by the health watcher, the device-plugin streams and the publisher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from webhook.agent.node import nvml

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """The state at one version: health and presence by card index, and why each Unhealthy card is so."""

    version: int
    healthy: dict[int, bool]
    present: dict[int, bool]
    closed: bool = False
    reasons: dict[int, str] = field(default_factory=dict)


class Board:
    """Versioned card state; readers block until the version moves past the one they saw."""

    def __init__(self, cards: list[nvml.Card]) -> None:
        self._cards = {c.uuid: c for c in cards}
        self._healthy = {c.index: True for c in cards}
        self._present = {c.index: True for c in cards}
        self._holds: dict[int, str] = {}  # card index -> why the agent keeps it Unhealthy (its MPS daemon is down)
        self._reasons: dict[int, str] = {}  # card index -> what the backend said when it turned the card Unhealthy
        self._version = 0
        self._closed = False
        self._cond = threading.Condition()

    def _snapshot(self) -> Snapshot:
        healthy = {k: ok and k not in self._holds for k, ok in self._healthy.items()}
        # The driver's word first: a card that NVML reports bad and whose MPS daemon is down is bad for NVML's reason.
        reasons = {k: self._reasons.get(k, "") if not self._healthy[k] else self._holds.get(k, "")
                   for k, ok in healthy.items() if not ok}
        return Snapshot(self._version, healthy, dict(self._present), self._closed, reasons)

    def hold(self, index: int, reason: str | None) -> bool:
        """Keep card ``index`` Unhealthy for ``reason`` (None lifts it); True when that changed anything.

        NVML's view of the card is kept apart: a card held for its MPS daemon that the driver also
        reports bad stays Unhealthy when the daemon recovers.
        """
        with self._cond:
            if index not in self._healthy or self._holds.get(index) == reason:
                return False
            if reason is None:
                del self._holds[index]
            else:
                self._holds[index] = reason
            self._version += 1
            self._cond.notify_all()
        log.warning("gpushard: card %d %s", index, f"held Unhealthy: {reason}" if reason else "no longer held")
        return True

    def snapshot(self) -> Snapshot:
        with self._cond:
            return self._snapshot()

    def apply(self, event: nvml.HealthEvent) -> bool:
        """Record a health change; True when it changed anything."""
        card = self._cards.get(event.uuid)
        if card is None:
            log.info("gpushard: ignoring an event for unknown card %s", event.uuid)
            return False
        healthy = event.healthy and event.present
        with self._cond:
            if self._healthy[card.index] == healthy and self._present[card.index] == event.present:
                return False
            self._healthy[card.index] = healthy
            self._present[card.index] = event.present
            if healthy:
                self._reasons.pop(card.index, None)
            else:
                self._reasons[card.index] = event.reason or ("gone" if not event.present else "reported Unhealthy")
            self._version += 1
            self._cond.notify_all()
        log.warning("gpushard: card %d (%s) is now %s%s%s", card.index, card.uuid,
                    "Healthy" if healthy else "Unhealthy", "" if event.present else ", gone",
                    f": {event.reason}" if event.reason else "")
        return True

    def wait_change(self, seen: int | None, timeout: float,
                    interrupted: Callable[[], bool] = lambda: False) -> Snapshot | None:
        """The state once its version differs from ``seen`` (or the board closes).

        None when ``timeout`` passes, or when ``interrupted()`` turns true after a ``poke``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._version != seen or interrupted(), timeout)
            if self._closed or self._version != seen:
                return self._snapshot()
            return None

    def touch(self) -> None:
        """Move the version on with no health change: something else the streams list changed (a cordon)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def poke(self) -> None:
        """Wake every waiter so it can check its ``interrupted``."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def watch(devices: nvml.Devices, board: Board, stop: threading.Event,
          on_change: Callable[[], None] | None = None, tick: float = 0.5) -> None:
    """Feed the backend's health events into the board until ``stop`` is set."""
    while not stop.is_set():
        try:
            event = devices.wait_event(tick)
        except Exception:  # a broken backend must not kill the agent silently; keep trying
            log.exception("gpushard: reading GPU health failed")
            stop.wait(tick)
            continue
        if event is not None and board.apply(event) and on_change is not None:
            on_change()
