"""A cluster view read from a YAML file, for local runs, demos and tests."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from webhook import settings
from webhook.core import extended, names, placement

# How long a placement counts on its card; the live view (kube.py) uses the same.
REMEMBER_TTL_S = 30.0


class ViewFileError(ValueError):
    """A cluster file gpushard cannot read; the message names the field."""


def _int(where: str, value: Any, default: int | None = None, minimum: int = 0) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ViewFileError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def _str_map(where: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ViewFileError(f"{where}: must be a mapping, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


def parse(data: Any, shares_per_card: int, source: str = "<view>") -> placement.View:
    """The view described by a parsed cluster file (as examples/cluster.yaml; a card may also say ``healthy: false``
    or ``cordoned: true``: no room for new pods, its ``usedShares`` still held)."""
    return parse_file(data, shares_per_card, source)[0]


def parse_file(data: Any, shares_per_card: int, source: str = "<view>"
               ) -> tuple[placement.View, Mapping[str, extended.Served]]:
    """A parsed cluster file: its view, and the extended resources its ``deviceClasses`` serve."""
    return _nodes(data, shares_per_card, source), device_classes(data)


def device_classes(data: Any) -> Mapping[str, extended.Served]:
    """What the file's optional ``deviceClasses`` serve: each ``{name, extendedResourceName, driver}``, a
    DeviceClass of another driver with ``spec.extendedResourceName`` (driver: the one its selector names)."""
    raw = data.get("deviceClasses") if isinstance(data, dict) else None
    if raw is None:
        return extended.NONE
    if not isinstance(raw, list):
        raise ViewFileError(f"deviceClasses: must be a list, got {raw!r}")
    objects, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"deviceClasses[{i}]"
        if not isinstance(entry, dict):
            raise ViewFileError(f"{where}: must be a mapping with name and extendedResourceName, got {entry!r}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ViewFileError(f"{where}.name: every DeviceClass needs a name, got {name!r}")
        if name in seen:
            raise ViewFileError(f"{where}.name: DeviceClass {name!r} is listed twice")
        seen.add(name)
        resource = entry.get("extendedResourceName")
        problem = extended.name_problem(resource)
        if problem:
            raise ViewFileError(f"{where}.extendedResourceName: {problem}, got {resource!r}")
        driver = entry.get("driver", "")
        problem = extended.driver_problem(driver) if driver != "" else None
        if problem:
            raise ViewFileError(f"{where}.driver: {problem}, got {driver!r}")
        # As the API server would hold the class, so that the one reader of classes reads it.
        selectors = [{"cel": {"expression": f'device.driver == "{driver}"'}}] if driver else []
        objects.append({"metadata": {"name": name}, "spec": {"extendedResourceName": resource, "selectors": selectors}})
    return extended.served_by(objects)


def _nodes(data: Any, shares_per_card: int, source: str) -> placement.View:
    if not isinstance(data, dict) or not isinstance(data.get("nodes", []), list):
        raise ViewFileError(f"{source}: expected a mapping with a list under 'nodes'")
    nodes = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("nodes") or []):
        where = f"nodes[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
            raise ViewFileError(f"{where}.name: every node needs a name")
        for key in ("taints", "cards"):
            if not isinstance(raw.get(key) or [], list):
                raise ViewFileError(f"{where}.{key}: must be a list, got {raw[key]!r}")
        taints = []
        for j, t in enumerate(raw.get("taints") or []):
            if not isinstance(t, dict) or not t.get("key"):
                raise ViewFileError(f"{where}.taints[{j}]: a taint needs a key, got {t!r}")
            taints.append(placement.Taint(str(t["key"]), str(t.get("value") or ""),
                                          str(t.get("effect") or "NoSchedule")))
        cards = []
        for j, c in enumerate(raw.get("cards") or []):
            cw = f"{where}.cards[{j}]"
            if not isinstance(c, dict):
                raise ViewFileError(f"{cw}: must be a mapping, got {c!r}")
            capacity = _int(f"{cw}.capacity", c.get("capacity"), shares_per_card)
            if c.get("healthy", True) is False:
                capacity = 0
            cordoned = c.get("cordoned", False)
            if not isinstance(cordoned, bool):
                raise ViewFileError(f"{cw}.cordoned: must be true or false, got {cordoned!r}")
            cards.append(placement.Card(
                index=_int(f"{cw}.index", c.get("index")),
                capacity=capacity,
                used=_int(f"{cw}.usedShares", c.get("usedShares"), 0),
                uuid=str(c.get("uuid") or ""),
                model=str(c.get("model") or ""),
                memory_mib=_int(f"{cw}.memoryMiB", c.get("memoryMiB"), 0),
                cordoned=cordoned,
            ))
        indexes = [c.index for c in cards]
        if len(set(indexes)) != len(indexes):
            raise ViewFileError(f"{where}.cards: card indexes repeat: {indexes}")
        if raw["name"] in seen:
            raise ViewFileError(f"{where}.name: node {raw['name']!r} is listed twice")
        seen.add(raw["name"])
        # Each card's memory label, as the agent publishes it, unless the file says otherwise.
        labels = {names.card_memory_label(c.index): str(c.memory_mib) for c in cards if c.memory_mib}
        labels.update(_str_map(f"{where}.labels", raw.get("labels")))
        nodes.append(placement.Node(
            name=raw["name"],
            labels=labels,
            taints=tuple(taints),
            ready=raw.get("ready", True) is not False,
            unschedulable=bool(raw.get("unschedulable", False)),
            cards=tuple(cards),
        ))
    return placement.View(nodes=tuple(nodes))


def load(path: str | Path, shares_per_card: int) -> placement.View:
    return load_file(path, shares_per_card)[0]


def load_file(path: str | Path, shares_per_card: int) -> tuple[placement.View, Mapping[str, extended.Served]]:
    """A cluster file's view and the extended resources its DeviceClasses serve (every part checked)."""
    path = Path(path)
    data = settings.read_yaml(path, "cluster file", ViewFileError)
    return parse_file(data, shares_per_card, str(path))


class StaticView:
    """A file's view plus the shares this process has placed on it lately.

    The file never learns of the pods that gpushard places, nor of their end; each placement
    counts for ``remember_ttl`` seconds, as in the live view, long enough for a burst of pods to
    spread over the cards with room, without the view filling up for good in a long-running demo.
    """

    def __init__(self, view: placement.View, remember_ttl: float = REMEMBER_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._base = {n.name: n for n in view.nodes}
        self._ttl = remember_ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: collections.deque = collections.deque()  # (deadline, node, card, shares), oldest first
        self._placed: collections.Counter = collections.Counter()  # (node, card) -> shares
        self._view = view
        self._positions = {n.name: i for i, n in enumerate(view.nodes)}  # where each node sits in _view
        # Where each card index sits among its node's cards, for nodes whose indexes do not repeat
        # (a file's never do); the static view never changes which cards a node has.
        self._card_at = {n.name: {c.index: j for j, c in enumerate(n.cards)} for n in view.nodes
                         if len({c.index for c in n.cards}) == len(n.cards)}

    def synced(self) -> bool:
        return True

    def snapshot(self) -> placement.View:
        with self._lock:
            due = bool(self._entries) and self._entries[0][0] <= self._clock()
        if due:
            with self._lock:
                now, touched = self._clock(), set()
                while self._entries and self._entries[0][0] <= now:
                    _deadline, node, card, shares = self._entries.popleft()
                    self._placed[(node, card)] -= shares
                    touched.add((node, card))
                # Expiries come one or two per snapshot at a steady rate: each moves one card back,
                # as its remember moved it; a burst of them rebuilds the nodes at once.
                if len(touched) <= placement.FEW_CHANGES:
                    for node, card in touched:
                        self._update_card(node, card)
                else:
                    self._update({node for node, _card in touched})
        return self._view

    def remember(self, node: str | None, card: int, shares: int) -> None:
        """Count a placement that the file cannot know of (never called for dry runs)."""
        if node is None or node not in self._base or shares <= 0:
            return
        with self._lock:
            self._entries.append((self._clock() + self._ttl, node, card, shares))
            self._placed[(node, card)] += shares
            self._update_card(node, card)

    def _update_card(self, name: str, index: int) -> None:
        """``_update({name})`` when only card ``index`` of the node can have changed: that card alone
        is rebuilt, and the view's indexes move it (placement.replace_card) instead of redoing the node."""
        position = self._positions.get(name)
        current = self._view.node(position) if position is not None else None
        if current is None or current.name != name:
            self._positions = {n.name: i for i, n in enumerate(self._view.nodes)}
            self._update({name})
            return
        j = self._card_at.get(name, {}).get(index)
        if j is None:  # no such card, or the index twice: the general path decides
            self._update({name})
            return
        base = self._base[name].cards[j]
        c = current.cards[j]
        used = base.used + self._placed[(name, index)]
        if used == c.used:
            return
        self._view = placement.replace_card(self._view, current.with_card(j, c.with_used(used)), j)

    def _update(self, touched: set[str]) -> None:
        changes = {}
        for name in touched:
            n = self._base[name]
            changes[name] = placement.Node(n.name, n.labels, n.taints, n.ready, n.unschedulable, tuple(
                c.with_used(c.used + self._placed[(name, c.index)]) for c in n.cards))
        self._view = placement.replace_nodes(self._view, changes)

    def close(self) -> None:
        pass
