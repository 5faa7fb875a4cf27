"""The remembered choices of the live view: each counted on its node until a pod accounts for it or it expires.

The ledger only keeps the entries in order and finds them; the view (``kube.KubeView``) counts
their shares on its cards, decides when one expires, and calls it under its own lock. Entries
share one time to live, so they expire in the order they were made: the oldest is the next due,
found in constant time however many went before it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass

# The node a choice that fits nowhere is remembered on (kube.WAITING): none, only its card index.
WAITING = ""


@dataclass(slots=True)
class Entry:
    """A choice counted on its node until a pod accounts for it or it expires."""

    node: str
    card: int
    shares: int
    deadline: float
    held_deadline: float = math.inf  # how long it counts while the pods watch is down
    number: int = 0  # its place among the remembered choices, oldest first


class Ledger:
    """Remembered choices, oldest first, and the same by (card, shares) and by (node, card, shares),
    for a pod to find its own. Not thread-safe: its owner holds a lock around every call."""

    def __init__(self) -> None:
        # OrderedDicts: their first item is found in constant time however many went before it,
        # where a plain dict scans the slots of the items deleted from its front.
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._by_ask: dict[tuple, collections.OrderedDict[int, Entry]] = {}
        self._by_place: dict[tuple, collections.OrderedDict[int, Entry]] = {}
        self._numbers = 0
        self.next_deadline = math.inf  # the oldest entry's deadline; inf with none

    def oldest(self) -> Entry:
        return next(iter(self.entries.values()))

    def add(self, entry: Entry) -> None:
        self._numbers += 1
        entry.number = self._numbers
        self.entries[entry.number] = entry
        _file(self._by_ask, (entry.card, entry.shares), entry)
        _file(self._by_place, (entry.node, entry.card, entry.shares), entry)
        if entry.deadline < self.next_deadline:
            self.next_deadline = entry.deadline

    def drop(self, entry: Entry) -> None:
        del self.entries[entry.number]
        for table, key in ((self._by_ask, (entry.card, entry.shares)),
                           (self._by_place, (entry.node, entry.card, entry.shares))):
            group = table[key]
            del group[entry.number]
            if not group:
                del table[key]
        # Entries are kept in the order they expire: the oldest left is the next due.
        self.next_deadline = next(iter(self.entries.values())).deadline if self.entries else math.inf

    def entry_for(self, shares: dict[int, int], preferred: str | None, node: str | None) -> Entry | None:
        """The oldest remembered choice that a pod holding ``shares`` accounts for, if any.

        A pod with gpushard's preferred term (``preferred``) was chosen on that node: only an
        entry there can be its own (another replica's pod of the same size must not take this
        process's entry). A pod without one takes the oldest entry of its card and shares,
        preferring its node, and an unbound one a choice that fit nowhere (WAITING) first.
        """
        card, count = min(shares.items())
        if preferred:
            group = self._by_place.get((preferred, card, count))
        else:
            group = self._by_place.get((node or WAITING, card, count))
            group = group or self._by_ask.get((card, count))
        return next(iter(group.values())) if group else None

    def entry_on(self, node: str, cards: Iterable[int], count: int) -> Entry | None:
        """The oldest remembered choice of ``count`` shares on any of ``cards`` of ``node``: the one a pod
        hinted to ``node`` accounts for when its card is not written in it (backend dra)."""
        best = None
        for card in cards:
            group = self._by_place.get((node, card, count))
            if group:
                entry = next(iter(group.values()))
                if best is None or entry.number < best.number:
                    best = entry
        return best


def _file(table: dict[tuple, collections.OrderedDict[int, Entry]], key: tuple, entry: Entry) -> None:
    """``entry`` in ``table``'s group for ``key``, made when it is the group's first."""
    group = table.get(key)
    if group is None:  # not setdefault: that would build an OrderedDict on every call
        group = table[key] = collections.OrderedDict()
    group[entry.number] = entry
