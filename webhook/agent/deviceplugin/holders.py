"""Who holds which ID of the node-wide shares resource, and on which card: what its health follows.

The kubelet picks a container's IDs of ``gpushard.io/gpu`` without knowing its card, so the IDs
name none (``allocation.pool_id``), and the card comes from the kubelet's PodResources ``List``:
the container's ``<cardPrefix><k>`` IDs, or under backend dra the card of the claim prepared for
its pod. A List costs the kubelet little but is not free, so it is read when it can change the
list: when the cards' state moves, when an ID we did not list Healthy was allocated, and every
``refresh`` seconds only while the list depends on who holds what (a card is down).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

REFRESH_S = 5.0
# The kubelet records a container's IDs only after our Allocate answers, so a List taken just
# then may miss them: an allocated ID counts as held for this long even when a List lacks it.
GRACE_S = 10.0


class Holders:
    """The IDs containers hold, each with its container's card (None: not known), read on demand.

    ``read`` answers ``{id: card or None}`` from the kubelet, or raises; without one (or while
    it fails) the IDs handed out since start count as held on unknown cards: kept Healthy, so a
    pod on a healthy card is never marked, at the cost of the node's count while a card is down.
    """

    def __init__(self, read: Callable[[], Mapping[str, int | None]] | None, refresh: float = REFRESH_S,
                 grace: float = GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self.refresh = refresh
        self.grace = grace
        self._clock = clock
        self._lock = threading.Lock()  # the state below
        self._reading = threading.Lock()  # one List at a time; Allocate never waits for one
        self._listed: dict[str, int | None] = {}  # the last List's answer
        self._read_ok = False
        self._read_at: float | None = None  # when the last List started
        self._read_for: int | None = None  # the board version it was read for
        self._recent: dict[str, float] = {}  # IDs from Allocate -> when
        self._handed: set[str] = set()  # every ID Allocate saw since start
        self._healthy_listed: set[str] = set()
        self._dirty = False
        self._depends = False
        self._failing = False

    def allocated(self, devices: Iterable[str]) -> None:
        """Note the IDs an Allocate of the node-wide resource handed out."""
        now = self._clock()
        with self._lock:
            for device in devices:
                self._recent[device] = now
                self._handed.add(device)
                if device not in self._healthy_listed:
                    # The kubelet chose it before our list marked it Unhealthy: ours to look at again.
                    self._dirty = True

    def listed(self, devices: Iterable[tuple[str, str]], depends: bool, healthy: str) -> None:
        """What the stream sent: the IDs it listed ``healthy``, and whether the list depends on the holders."""
        with self._lock:
            self._healthy_listed = {d for d, h in devices if h == healthy}
            self._depends = depends

    def _due(self, version: int, now: float) -> bool:
        if self._read is None:
            return False
        if self._read_for != version or self._dirty:
            return True
        return (self._depends or not self._read_ok) and self._read_at is not None and \
            now - self._read_at >= self.refresh

    def held(self, version: int) -> dict[str, int | None]:
        """The holders, read again for board ``version`` when due (this call then waits for the List)."""
        now = self._clock()
        with self._lock:
            due = self._due(version, now)
        if due:
            with self._reading:
                with self._lock:
                    due = self._due(version, self._clock())  # another stream may have read meanwhile
                    self._dirty = False
                if due:
                    self._refresh(version)
        with self._lock:
            return self._current()

    def _refresh(self, version: int) -> None:
        started = self._clock()
        assert self._read is not None  # never due without a reader
        try:
            answer = dict(self._read())
        except Exception as exc:  # PodResources away (no socket, a kubelet restarting): fall back, try later
            with self._lock:
                self._read_ok, self._read_at, self._read_for = False, started, version
                failing, self._failing = self._failing, True
            if not failing:
                log.warning("gpushard: cannot read the kubelet's PodResources (%s): while it fails, every ID of the "
                            "node-wide shares resource handed out since the agent started stays Healthy, whatever "
                            "the card of the pod holding it (check the agent's --pod-resources-socket)", exc)
            return
        with self._lock:
            self._listed, self._read_ok, self._read_at, self._read_for = answer, True, started, version
            failing, self._failing = self._failing, False
        if failing:
            log.info("gpushard: the kubelet's PodResources answers again")

    def _current(self) -> dict[str, int | None]:
        if not self._read_ok:
            return dict.fromkeys(self._handed)
        assert self._read_at is not None  # set with _read_ok
        found = dict(self._listed)
        for device, when in list(self._recent.items()):
            if device in found or self._read_at - when > self.grace:
                del self._recent[device]  # seen by the kubelet's List, or released since: the List says
            else:
                found[device] = None
        return found
