"""The view placement chooses over: a read-only snapshot of the shared nodes, with its indexes.

A choice must stay well under a millisecond over thousands of nodes, so a view carries two
indexes, built lazily and cached on the frozen object:

- who may run where: for each distinct set of scheduling constraints (node selector, required
  node affinity, tolerations), the eligible nodes as a bitset over node positions. It depends
  only on labels, taints, readiness and cordon, so views that differ only in shares share it.
- what is free where: for each free-share count, the cards that have exactly that many shares
  free, as one bitset over (card index, node) slots. A cordoned card has none free (``Card.free``):
  it sits at 0 or below, where no pod fits, and its pods still count.

Placement asks them through the view's queries (``candidates``, ``best``, ``draw``,
``most_free``, ``card_indexes``, ``sizes``, and for cordoned cards ``open_indexes`` and
``cordoned_on``), which answer in bitsets over node positions
(``node(i)``; ``lowest_node(bits)``). ``replace_nodes`` derives a new view from an old one by
updating the indexes for the changed nodes only, as a live view needs on every watch event.
The results are exactly those of the plain scan over ``view.nodes``.
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import threading
import zlib
from collections.abc import Mapping, Sequence

from webhook.core.scheduling import Ask, Card, Node, card_memory_mib, eligible, same_scheduling

# Distinct constraint sets whose eligible nodes a view family keeps; pods of one workload share
# one set, so a few hundred cover a large cluster, and each entry is one big integer.
MASK_CACHE_SIZE = 256


# A view keeps its nodes in chunks of this many, so that a view derived for one changed node
# copies one chunk and the list of chunks, not every node: a remembered choice over 2,000 nodes
# copied 2,000 references (about 8 us) to change one.
CHUNK = 64
# Up to this many changed nodes, a derived view replaces them chunk by chunk; past it, it is
# built anew from all nodes (a relist, a burst of expiries).
FEW_CHANGES = 8


class View:
    """A read-only snapshot of the shared nodes and the shares held on their cards.

    Node names are unique in the views gpushard builds; ``replace_nodes`` relies on it.
    ``nodes`` is a tuple, made when first read for a derived view; placement reads a node by its
    position (``node``) without making it.
    """

    __slots__ = ("_chunks", "size", "__dict__")
    _chunks: tuple[tuple[Node, ...], ...]
    size: int

    def __init__(self, nodes: tuple[Node, ...] = ()) -> None:
        nodes = tuple(nodes)
        self.__dict__["nodes"] = nodes
        object.__setattr__(self, "_chunks", tuple(nodes[i:i + CHUNK] for i in range(0, len(nodes), CHUNK)))
        object.__setattr__(self, "size", len(nodes))

    @classmethod
    def _of_chunks(cls, chunks: tuple[tuple[Node, ...], ...], size: int) -> View:
        view = cls.__new__(cls)
        object.__setattr__(view, "_chunks", chunks)
        object.__setattr__(view, "size", size)
        return view

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a View is read-only: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        return self.nodes == other.nodes if isinstance(other, View) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable on purpose: nodes hold their labels in dicts

    def __repr__(self) -> str:
        return f"View(nodes={self.nodes!r})"

    @functools.cached_property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(node for chunk in self._chunks for node in chunk)

    def node(self, i: int) -> Node:
        """The node at position ``i``."""
        return self._chunks[i // CHUNK][i % CHUNK]

    def with_node(self, i: int, node: Node) -> View:
        """This view's nodes with ``node`` at position ``i``, as a new view without indexes."""
        c, j = divmod(i, CHUNK)
        chunk = self._chunks[c]
        return View._of_chunks((*self._chunks[:c], (*chunk[:j], node, *chunk[j + 1:]), *self._chunks[c + 1:]),
                               self.size)

    @functools.cached_property
    def waiting(self) -> Mapping[int, tuple[int, ...]]:
        """Per card index, the shares of each pod that waits on that index and stands on no node (it fit
        nowhere): what new nodes would take. The live view sets it (``with_waiting``); empty otherwise."""
        return {}

    @functools.cached_property
    def priorities(self) -> Mapping[tuple[str, int], tuple[tuple[int, int], ...]]:
        """Per (node, card index), the shares that bound pods of each priority other than 0 hold, as (priority,
        shares) pairs in priority order; the rest of a card's used shares are of priority 0. The live view sets
        it (``with_priorities``); empty otherwise."""
        return {}

    @functools.cached_property
    def priority_floor(self) -> int | None:
        """The lowest priority of the pods that hold shares (0 where pods of priority 0 hold some), None with no
        pod: no pod of this priority or below can have another preempted for it. The live view sets it with
        ``with_priorities``; otherwise it is read from ``priorities`` and the cards."""
        ranked = self.priorities
        lowest = min((p for pairs in ranked.values() for p, _shares in pairs), default=None)
        for node in self.nodes:
            for card in node.cards:
                if card.used > sum(s for _p, s in ranked.get((node.name, card.index), ())):
                    return 0 if lowest is None else min(lowest, 0)
        return lowest

    def with_priorities(self, priorities: Mapping[tuple[str, int], tuple[tuple[int, int], ...]],
                        floor: int | None | object = ...) -> View:
        """This view with ``priorities`` and, when given, their ``floor`` (else read when first asked), sharing its
        nodes and indexes."""
        view = View._of_chunks(self._chunks, self.size)
        view.__dict__.update(self.__dict__)
        view.__dict__["priorities"] = priorities
        view.__dict__.pop("priority_floor", None)
        if floor is not ...:
            view.__dict__["priority_floor"] = floor
        return view

    def with_waiting(self, waiting: Mapping[int, tuple[int, ...]]) -> View:
        """This view with ``waiting``, sharing its nodes and indexes."""
        view = View._of_chunks(self._chunks, self.size)
        view.__dict__.update(self.__dict__)
        view.__dict__["waiting"] = waiting
        return view

    # Lazily built indexes (see the module docstring). cached_property writes to the instance
    # dict directly; replace_nodes seeds them the same way.
    @functools.cached_property
    def _topology(self) -> _Topology:
        return _Topology.build(self.nodes)

    @functools.cached_property
    def _usage(self) -> _Usage:
        return _Usage.build(self.nodes)

    # --- the queries placement asks: node sets are bitsets over node positions --------------------

    def candidates(self, ask: Ask, pin: int | None) -> int:
        """The nodes ``ask`` may run on that have card ``pin`` (any card when None)."""
        usage = self._usage
        return self._topology.mask(ask) & (usage.has_any if pin is None else usage.has_k.get(pin, 0))

    def best(self, nodes: int, pin: int | None, shares: int, strategy: str) -> tuple[int, int] | None:
        """(node position, card index) of the best card among ``nodes`` with ``shares`` free: binpack,
        the fullest; spread, the emptiest; ties to the lower index, then the earlier node."""
        return self._usage.search(nodes, pin, shares, strategy)

    def most_free(self, nodes: int, pin: int | None) -> tuple[int, int] | None:
        """(node position, card index) of the card among ``nodes`` with the most free shares."""
        return self._usage.most_free(nodes, pin)

    def draw(self, nodes: int, pin: int | None, shares: int, strategy: str, slack: int, count: int, rng,
             masks: Mapping[int, int] | None = None) -> tuple[int, int] | None:
        """(node position, card index) drawn uniformly with ``rng`` among the first ``count`` cards
        among ``nodes`` with ``shares`` free, in ``best``'s order, whose free shares are within
        ``slack`` of the best one's (without ``rng``, the first of them); None when none fits.
        ``masks``: per card index, the nodes to look at instead of ``nodes`` and ``pin``."""
        return self._usage.draw(nodes, pin, shares, strategy, slack, count, rng, masks)

    def share_of(self, nodes: int, rank: int, count: int) -> dict[int, int]:
        """Per card index, the nodes among ``nodes`` whose card of that index is replica ``rank``'s of
        ``count``: card ``k`` of a node whose name hashes to ``h`` is replica ``(h + k) mod count``'s. Each
        replica gets a card index of every node in turn, so replicas share the cards evenly whatever the
        number of cards per node."""
        classes = _residues(self, count)
        return {k: nodes & classes[(rank - k) % count] for k in self.card_indexes(nodes)}

    def card_indexes(self, nodes: int) -> list[int]:
        """The card indexes that some of ``nodes`` have, in order."""
        usage = self._usage
        return [k for k in usage.ks if usage.has_k.get(k, 0) & nodes]

    def sizes(self) -> dict[int, dict[int, int]]:
        """Card size in MiB -> card index -> the nodes whose card of that index has that size."""
        return _sizes(self)

    def common_indexes(self, nodes: int) -> list[int]:
        """The card indexes that every one of ``nodes`` has, in order."""
        usage = self._usage
        return [k for k in usage.ks if nodes and usage.has_k.get(k, 0) & nodes == nodes]

    def open_indexes(self, nodes: int) -> list[int]:
        """The card indexes that some of ``nodes`` have and have not cordoned, in order."""
        usage, cordons = self._usage, _cordons(self)
        if not cordons:
            return self.card_indexes(nodes)
        return [k for k in usage.ks if usage.has_k.get(k, 0) & nodes & ~cordons.get(k, 0)]

    def cordoned_on(self, nodes: int, k: int) -> bool:
        """Whether card ``k`` is cordoned on every one of ``nodes`` that has such a card (and one has)."""
        have = self._usage.has_k.get(k, 0) & nodes
        return bool(have) and not have & ~_cordons(self).get(k, 0)


# --- indexes -----------------------------------------------------------------------------------


# Built once: json.dumps with options builds a new encoder per call.
_KEY_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=repr)


# Keys already made, by the repr of their parts: repr is about half the price of the sorted JSON, and
# pods of one workload spell their constraints alike. Bounded in count and in the text kept.
_KEYS: dict[str, str] = {}
KEYS_KEPT = 1024
KEY_TEXT_KEPT = 2048


_NO_CONSTRAINTS = _KEY_ENCODER.encode([{}, [], []])


def _constraints_key(ask: Ask) -> str:
    """One string per distinct set of scheduling constraints (the node name aside)."""
    selector, terms, tolerations = ask.node_selector, ask.required_terms, ask.tolerations
    if not selector and not terms and not tolerations:
        return _NO_CONSTRAINTS
    # Spelled as the pod holds them (a selector that is not a dict made one first, so that its
    # repr cannot pass for another's): only the cache's key, so no copies into lists for it.
    spelled = repr((selector if type(selector) is dict else dict(selector), terms, tolerations))
    key = _KEYS.get(spelled)
    if key is not None:
        return key
    parts = [dict(selector), list(terms), list(tolerations)]
    try:
        key = _KEY_ENCODER.encode(parts)
    except (TypeError, ValueError):  # keys of mixed types cannot be sorted: fall back to repr
        key = spelled
    if len(spelled) <= KEY_TEXT_KEPT:
        if len(_KEYS) >= KEYS_KEPT:
            _KEYS.clear()
        _KEYS[spelled] = key
    return key


def lowest_node(bits: int) -> int:
    """The first node position in a bitset of nodes."""
    return (bits & -bits).bit_length() - 1


class _Topology:
    """Node positions and, per constraint set, the bitset of nodes a pod may run on."""

    __slots__ = ("nodes", "by_name", "masks", "lock")

    def __init__(self, nodes: tuple[Node, ...], by_name: dict[str, tuple[int, ...]],
                 masks: collections.OrderedDict):
        self.nodes = nodes  # only their scheduling fields are read here
        self.by_name = by_name
        self.masks = masks  # constraints key -> (ask, bitset); least recently used first
        self.lock = threading.Lock()

    @classmethod
    def build(cls, nodes: tuple[Node, ...]) -> _Topology:
        by_name: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            by_name.setdefault(node.name, []).append(i)
        return cls(nodes, {k: tuple(v) for k, v in by_name.items()}, collections.OrderedDict())

    def _compute(self, ask: Ask) -> int:
        bits = 0
        for i, node in enumerate(self.nodes):
            if eligible(node, ask):
                bits |= 1 << i
        return bits

    def mask(self, ask: Ask) -> int:
        """The nodes this pod may run on, capacity aside."""
        if ask.node_name:
            bits = 0
            for i in self.by_name.get(ask.node_name, ()):
                if eligible(self.nodes[i], ask):
                    bits |= 1 << i
            return bits
        key = _constraints_key(ask)
        with self.lock:
            hit = self.masks.get(key)
            if hit is not None:
                self.masks.move_to_end(key)
                return hit[1]
        bits = self._compute(ask)
        with self.lock:
            self.masks[key] = (ask, bits)
            while len(self.masks) > MASK_CACHE_SIZE:
                self.masks.popitem(last=False)
        return bits

    def derive(self, nodes: tuple[Node, ...], changed: list[int]) -> _Topology:
        """The topology after the nodes at ``changed`` positions changed or were appended."""
        if len(nodes) != len(self.nodes):
            by_name = dict(self.by_name)
            for i in range(len(self.nodes), len(nodes)):
                by_name[nodes[i].name] = by_name.get(nodes[i].name, ()) + (i,)
        else:
            by_name = self.by_name
        with self.lock:
            entries = list(self.masks.items())
        masks = collections.OrderedDict()
        for key, (ask, bits) in entries:
            for i in changed:
                bit = 1 << i
                bits = (bits | bit) if eligible(nodes[i], ask) else (bits & ~bit)
            masks[key] = (ask, bits)
        return _Topology(nodes, by_name, masks)


class _Usage:
    """Per free-share count, the cards that free, as one bitset over (card index, node) slots.

    ``levels[free]`` is (bits, count): bit ``s * stride + i`` stands for the card of index ``ks[s]``
    of the node at position ``i``, and count is how many bits are set. Within a level the bits run
    by card index, then by node, which is the order the choice breaks ties in. A choice then
    reads a level with one AND and counts its cards with one bit count (a pod that may run on
    every node with cards, the usual pod of a pool of like GPU nodes, reads the count as kept),
    where a table per card index took a lookup per index and level (about 20 per drawn choice);
    a remembered choice moves one bit between two levels of one table. ``stride`` leaves room
    past the last node, so that a node added at the end keeps the layout.

    A level whose last card leaves stays in the table, empty, until empty levels are half of it:
    deleting it would leave a hole in the dict, and the next copy of a dict with holes re-inserts
    every entry, where one without copies its table whole. ``fs`` lists only the levels with
    cards, kept in order by inserting and removing one level, not by sorting them all.
    """

    __slots__ = ("levels", "fs", "layout", "has_k", "has_any", "empty")

    def __init__(self, levels: dict[int, tuple[int, int]], fs: list[int], layout: _Layout, has_k: dict[int, int],
                 has_any: int, empty: int = 0):
        self.levels = levels  # free shares -> (cards that free over (card index, node) slots, how many)
        self.fs = fs  # the free shares of the levels with cards, ascending
        self.layout = layout  # the slots: shared by every index derived without a rebuild
        self.has_k = has_k  # card index -> nodes that have such a card
        self.has_any = has_any  # nodes with any card
        self.empty = empty  # how many levels are empty

    def _compacted(self) -> _Usage:
        """This index, without its empty levels once they are half the table."""
        if self.empty <= 8 or self.empty * 2 <= len(self.levels):
            return self
        levels = {free: level for free, level in self.levels.items() if level[1]}
        return _Usage(levels, self.fs, self.layout, self.has_k, self.has_any)

    @property
    def ks(self) -> list[int]:
        return self.layout.ks

    @classmethod
    def build(cls, nodes: tuple[Node, ...]) -> _Usage:
        by_kf: dict[int, dict[int, int]] = {}  # card index -> free shares -> nodes
        has_k: dict[int, int] = {}
        has_any = 0
        for i, node in enumerate(nodes):
            bit = 1 << i
            for card in node.cards:
                free = card.free
                table = by_kf.get(card.index)
                if table is None:
                    table = by_kf[card.index] = {}
                table[free] = table.get(free, 0) | bit
                has_k[card.index] = has_k.get(card.index, 0) | bit
            if node.cards:
                has_any |= bit
        stride = _stride(len(nodes))
        ks = sorted(by_kf)
        levels: dict[int, int] = {}
        for s, k in enumerate(ks):
            for free, bits in by_kf[k].items():
                levels[free] = levels.get(free, 0) | (bits << (s * stride))
        return cls({free: (bits, bits.bit_count()) for free, bits in levels.items()}, sorted(levels),
                   _Layout(ks, stride), has_k, has_any)

    def derive(self, old: Mapping[int, Node], new: Mapping[int, Node], view: View) -> _Usage:
        """The index of ``view``, whose nodes at ``old``'s positions became ``new``'s (which may add
        positions at the end). Built anew when a node lands past the stride or brings a card
        index without a slot; otherwise only the changed cards' bits move, in a copy of the
        levels table. The result equals ``_Usage.build`` over the new nodes."""
        stride, slot = self.layout.stride, self.layout.slot
        for i, node in new.items():
            if i >= stride or any(c.index not in slot for c in node.cards):
                return _Usage.build(view.nodes)
        changed: dict[int, int] = {}  # free shares -> the level's bits as they become
        levels = self.levels
        has_k, has_any = self.has_k, self.has_any
        fresh_k = False
        for i in set(old) | set(new):
            was_cards = old[i].cards if i in old else ()
            now_cards = new[i].cards if i in new else ()
            if was_cards is now_cards:
                continue
            gone: Sequence[Card]
            came: Sequence[Card]
            gone, came = was_cards, now_cards
            if len(was_cards) == len(now_cards):
                # The common case (a pod event): the same cards, a few of them new objects. Only
                # those move, unless an index repeats on the node (its bit is shared then).
                pairs = [(a, b) for a, b in zip(was_cards, now_cards, strict=True) if a is not b]
                if all(a.index == b.index for a, b in pairs) and len({c.index for c in now_cards}) == len(now_cards):
                    gone, came = [a for a, _b in pairs], [b for _a, b in pairs]
            bit = 1 << i
            for c in gone:
                free = c.free
                bits = changed[free] if free in changed else levels.get(free, (0, 0))[0]
                changed[free] = bits & ~(bit << (slot[c.index] * stride))
            for c in came:
                free = c.free
                bits = changed[free] if free in changed else levels.get(free, (0, 0))[0]
                changed[free] = bits | (bit << (slot[c.index] * stride))
            if gone is was_cards and {c.index for c in was_cards} != {c.index for c in now_cards}:
                if not fresh_k:
                    has_k, fresh_k = dict(has_k), True
                for c in was_cards:
                    has_k[c.index] &= ~bit
                for c in now_cards:
                    has_k[c.index] = has_k.get(c.index, 0) | bit
                for k in [k for k, bits in has_k.items() if not bits]:
                    del has_k[k]
            has_any = (has_any | bit) if now_cards else (has_any & ~bit)
        levels = dict(levels)
        resort, empty = False, self.empty
        for free, bits in changed.items():
            level = levels.get(free)
            if level is None:
                if not bits:
                    continue
                resort = True
            elif not level[1]:
                empty -= 1
                resort = resort or bool(bits)
            if bits:
                levels[free] = (bits, bits.bit_count())
            else:
                resort = resort or level is not None and bool(level[1])
                levels[free] = (0, 0)
                empty += 1
        fs = sorted(free for free, level in levels.items() if level[1]) if resort else self.fs
        return _Usage(levels, fs, self.layout, has_k, has_any, empty)._compacted()

    def moved(self, i: int, k: int, was: int, now: int) -> _Usage:
        """The index after card ``k`` of the node at position ``i`` (its only card ``k``) went from
        ``was`` to ``now`` free shares: one bit moves between two levels."""
        if was == now:
            return self  # never changed once made: the same index serves both views
        b = 1 << (self.layout.slot[k] * self.layout.stride + i)
        levels, fs, empty = dict(self.levels), self.fs, self.empty
        bits, n = levels[was]  # the card's bit is there, and not in level ``now``: its only card k
        levels[was] = (bits & ~b, n - 1)
        if n == 1:
            empty += 1
            fs = fs.copy()
            del fs[bisect.bisect_left(fs, was)]
        level = levels.get(now)
        if level is None or not level[1]:
            empty -= level is not None
            levels[now] = (b, 1)
            if fs is self.fs:
                fs = fs.copy()
            bisect.insort(fs, now)
        else:
            levels[now] = (level[0] | b, level[1] + 1)
        return _Usage(levels, fs, self.layout, self.has_k, self.has_any, empty)._compacted()

    def _wide(self, mask: int, pin: int | None, masks: Mapping[int, int] | None = None) -> int:
        """The slots of ``mask``'s nodes' cards (card ``pin`` only, when given); with ``masks``, the
        slots of each card index's own nodes."""
        layout = self.layout
        if masks is not None:
            out = 0
            for k, bits in masks.items():
                s = layout.slot.get(k)
                if s is not None:
                    out |= (bits & self.has_any) << (s * layout.stride)
            return out
        mask &= self.has_any
        if pin is not None:
            s = layout.slot.get(pin)
            return 0 if s is None else mask << (s * layout.stride)
        # The node bitset repeated in every slot: a multiplication of big integers, so kept per node
        # set (pods of one workload ask for the same nodes) for every index of the same layout.
        wide = layout.wide.get(mask)
        if wide is None:
            if len(layout.wide) >= MASK_CACHE_SIZE:
                layout.wide.clear()
            wide = layout.wide[mask] = mask * layout.rep
        return wide

    def _order(self, shares: int, strategy: str) -> range:
        """Positions in ``fs`` of the levels with room for ``shares``, best first."""
        fs = self.fs
        if strategy == "spread":
            return range(len(fs) - 1, bisect.bisect_left(fs, shares) - 1, -1)
        return range(bisect.bisect_left(fs, shares), len(fs))

    def search(self, mask: int, pin: int | None, shares: int, strategy: str) -> tuple[int, int] | None:
        """(node position, card index) of the best card for ``shares``, or None when none fits.

        Binpack wants the least free card with room, spread the most free; ties go to the lower
        card index, then to the earlier node, exactly as the plain scan breaks them.
        """
        return self._first(self._order(shares, strategy), mask, pin)

    def most_free(self, mask: int, pin: int | None) -> tuple[int, int] | None:
        """(node position, card index) of the card with the most free shares, fitting or not."""
        return self._first(range(len(self.fs) - 1, -1, -1), mask, pin)

    def _first(self, order: range, mask: int, pin: int | None) -> tuple[int, int] | None:
        wide = self._wide(mask, pin)
        if wide:
            levels, fs = self.levels, self.fs
            # Every card of a level is the pod's when it may run on every node with cards (see draw).
            every = pin is None and mask & self.has_any == self.has_any
            for j in order:
                found = levels[fs[j]][0] if every else levels[fs[j]][0] & wide
                if found:
                    s, i = divmod((found & -found).bit_length() - 1, self.layout.stride)
                    return i, self.layout.ks[s]
        return None

    def draw(self, mask: int, pin: int | None, shares: int, strategy: str, slack: int, count: int,
             rng, masks: Mapping[int, int] | None = None) -> tuple[int, int] | None:
        """(node position, card index) drawn uniformly among the first ``count`` cards that fit, in
        ``search``'s order, whose free shares are within ``slack`` of the best one's (the first of
        them without ``rng``); None when none fits. ``masks``: per card index, the nodes to look
        at instead of ``mask`` and ``pin`` (cards of one size)."""
        wide = self._wide(mask, pin, masks)
        if not wide:
            return None
        # Every card of the level is the pod's when it may run on every node with cards.
        every = masks is None and pin is None and mask & self.has_any == self.has_any
        levels, fs = self.levels, self.fs
        taken, total, best = [], 0, None
        for j in self._order(shares, strategy):
            free = fs[j]
            if best is not None and abs(free - best) > slack:
                break
            found, n = levels[free]
            if not every:
                found &= wide
                n = found.bit_count() if found else 0
            if n:
                if best is None:
                    best = free
                taken.append((found, n))
                total += n
                if total >= count or rng is None:
                    break
        if not total:
            return None
        total = min(total, count)
        r = rng.randrange(total) if rng is not None and total > 1 else 0
        for found, n in taken:
            if r < n:
                return self._locate(found, r)
            r -= n
        return None  # unreachable: r < total

    def _locate(self, found: int, r: int) -> tuple[int, int]:
        """(node position, card index) of the ``r``-th card (from 0) of ``found``."""
        layout = self.layout
        stride, low = layout.stride, layout.low
        s = 0
        # Slot by slot, counting each slot's part alone: a bit count over the whole level per step
        # (halving the slots) counted up to 5 levels' worth of bits for 2,000 nodes.
        while True:
            part = found & low
            n = part.bit_count() if part else 0
            if r < n:
                while r:
                    part &= part - 1  # drop the lowest node: the r-th is then the lowest
                    r -= 1
                return lowest_node(part), layout.ks[s]
            r -= n
            found >>= stride
            s += 1


class _Layout:
    """The slots of an index: card indexes ``ks`` (ascending; slot s is ``ks[s]``) of ``stride`` bits,
    with what a choice derives from them, shared by the indexes derived from one another."""

    __slots__ = ("ks", "slot", "stride", "rep", "low", "wide")

    def __init__(self, ks: list[int], stride: int):
        self.ks = ks
        self.slot = {k: s for s, k in enumerate(ks)}
        self.stride = stride
        self.rep = sum(1 << (s * stride) for s in range(len(ks)))  # a node bitset times rep: in every slot
        self.low = (1 << stride) - 1
        self.wide: dict[int, int] = {}  # node bitset -> the same in every slot (see _Usage._wide)


def _stride(size: int) -> int:
    """Slot width for ``size`` nodes: a multiple of 64 with an eighth to spare for nodes added later."""
    return (size + size // 8) // 64 * 64 + 64


def replace_nodes(view: View, changes: Mapping[str, Node | None]) -> View:
    """``view`` with nodes replaced by name, added (at the end) or removed (None).

    The view's indexes are carried over and updated for the changed nodes only (removing a
    node shifts the positions after it, and every bitset with them).
    """
    if not changes:
        return view
    topology = view._topology
    gone = sorted((i for name, node in changes.items() if node is None for i in topology.by_name.get(name, ())),
                  reverse=True) if None in changes.values() else ()
    if gone:
        view = _without(view, gone)
        topology = view._topology
    old: dict[int, Node] = {}
    new: dict[int, Node] = {}
    added: list[Node] = []
    for name, node in changes.items():
        if node is None:
            continue
        positions = topology.by_name.get(name)
        if positions is None:
            new[view.size + len(added)] = node
            added.append(node)
            continue
        for i in positions:
            old[i], new[i] = view.node(i), node
    if not new:
        return view  # only nodes it never had were removed
    if not added and len(new) <= FEW_CHANGES:
        # A watch event or a few remembered choices: a chunk copied per node, not every node.
        result = view
        for i, node in new.items():
            result = result.with_node(i, node)
    else:
        nodes = list(view.nodes)
        nodes.extend(added)
        for i, node in new.items():
            nodes[i] = node
        result = View(nodes=tuple(nodes))
    moved = [i for i in new if i not in old or not same_scheduling(old[i], new[i])]
    result.__dict__["_topology"] = topology.derive(result.nodes, moved) if moved else topology
    if "_sizes" in view.__dict__:  # only keep an index someone has paid for
        if not moved and all([c.index for c in old[i].cards] == [c.index for c in new[i].cards] for i in new):
            result.__dict__["_sizes"] = view.__dict__["_sizes"]  # the same labels and cards: the same sizes
        else:
            result.__dict__["_sizes"] = _sizes_with(view.__dict__["_sizes"], new)
    if "_cordons" in view.__dict__:
        result.__dict__["_cordons"] = _cordons_with(view.__dict__["_cordons"], new)
    if "_residues" in view.__dict__ and not added:  # the same names at the same positions
        result.__dict__["_residues"] = view.__dict__["_residues"]
    if "_usage" in view.__dict__:  # only keep an index someone has paid for
        result.__dict__["_usage"] = view._usage.derive(old, new, result)
    return result


def replace_card(view: View, node: Node, j: int) -> View:
    """``view`` with ``node`` in place of its namesake, which differs from it only in the shares used
    on card ``j`` (its only card of that index): ``replace_nodes`` for a remembered choice, without
    looking for what changed."""
    topology = view.__dict__.get("_topology")
    positions = topology.by_name.get(node.name) if topology is not None else None
    if positions is None or len(positions) != 1:
        return replace_nodes(view, {node.name: node})
    i = positions[0]
    was, now = view.node(i).cards[j], node.cards[j]
    result = view.with_node(i, node)
    result.__dict__["_topology"] = topology  # the same scheduling: only shares moved
    if "_sizes" in view.__dict__:
        result.__dict__["_sizes"] = view.__dict__["_sizes"]
    if "_cordons" in view.__dict__:  # only shares moved: the same cards are cordoned
        result.__dict__["_cordons"] = view.__dict__["_cordons"]
    if "_residues" in view.__dict__:
        result.__dict__["_residues"] = view.__dict__["_residues"]
    if "_usage" in view.__dict__:
        result.__dict__["_usage"] = view._usage.moved(i, now.index, was.free, now.free)
    return result


def _drop_bits(bits: int, gone: list[int]) -> int:
    """A bitset over node positions after the nodes at ``gone`` (descending) left and the rest moved up."""
    for i in gone:
        bits = (bits & ((1 << i) - 1)) | ((bits >> (i + 1)) << i)
    return bits


def _without(view: View, gone: list[int]) -> View:
    """``view`` without the nodes at positions ``gone`` (descending), its indexes carried over."""
    dropped = set(gone)
    result = View(nodes=tuple(n for i, n in enumerate(view.nodes) if i not in dropped))
    topology = view._topology
    with topology.lock:
        entries = list(topology.masks.items())
    moved = _Topology.build(result.nodes)
    for key, (ask, bits) in entries:
        moved.masks[key] = (ask, _drop_bits(bits, gone))
    result.__dict__["_topology"] = moved
    if "_usage" in view.__dict__:  # every position after the first gone moves: built anew
        result.__dict__["_usage"] = _Usage.build(result.nodes)
    return result


def _residues(view: View, count: int) -> tuple[int, ...]:
    """The nodes whose name's CRC-32 is ``c`` mod ``count``, for each ``c``: bitsets over node positions.

    A hash of the name, never the position: each replica's view lists the nodes in its own order.
    Cached on the view per count and carried by ``replace_card`` and by ``replace_nodes`` when no node
    came or went (a node replaced keeps its name, so its hash).
    """
    cached = view.__dict__.setdefault("_residues", {})
    found = cached.get(count)
    if found is None:
        bits = [0] * count
        for i, node in enumerate(view.nodes):
            bits[zlib.crc32(node.name.encode()) % count] |= 1 << i
        found = cached[count] = tuple(bits)
    return found


def _sizes(view: View) -> dict[int, dict[int, int]]:
    """Card size in MiB -> card index -> the nodes whose card of that index has that size, per labels.

    Labels only: a node without the agent's label cannot be matched by the affinity a memory ask gets.
    Cached on the view; ``replace_nodes`` and ``replace_card`` carry it to the views they derive,
    updated for the changed nodes only (building it over 2,000 nodes x 8 cards takes 15-25 ms).
    """
    cached = view.__dict__.get("_sizes")
    if cached is not None:
        return cached
    sizes: dict[int, dict[int, int]] = {}
    for i, node in enumerate(view.nodes):
        for card in node.cards:
            mib = card_memory_mib(node, card.index)
            if mib is not None:
                by_k = sizes.setdefault(mib, {})
                by_k[card.index] = by_k.get(card.index, 0) | (1 << i)
    view.__dict__["_sizes"] = sizes
    return sizes


def _sizes_with(sizes: dict[int, dict[int, int]], changed: Mapping[int, Node]) -> dict[int, dict[int, int]]:
    """``_sizes`` after the nodes at ``changed``'s positions became its nodes (positions may be new):
    their bits leave every table and come back where their labels now put them."""
    out = {mib: dict(by_k) for mib, by_k in sizes.items()}
    clear = 0
    for i in changed:
        clear |= 1 << i
    for by_k in out.values():
        for k in [k for k, bits in by_k.items() if bits & clear]:
            by_k[k] &= ~clear
            if not by_k[k]:
                del by_k[k]
    for i, node in changed.items():
        for card in node.cards:
            mib = card_memory_mib(node, card.index)
            if mib is not None:
                by_k = out.setdefault(mib, {})
                by_k[card.index] = by_k.get(card.index, 0) | (1 << i)
    return {mib: by_k for mib, by_k in out.items() if by_k}




def _cordons(view: View) -> dict[int, int]:
    """Card index -> the nodes that have that card cordoned, as a bitset over node positions.

    Cached on the view and carried by ``replace_nodes`` and ``replace_card``, updated for the changed
    nodes only; read where nothing fits (which index a pod waits on) and for a pin, never on the way
    to a card that fits, so a view that never reaches those pays nothing for it.
    """
    cached = view.__dict__.get("_cordons")
    if cached is not None:
        return cached
    found: dict[int, int] = {}
    for i, node in enumerate(view.nodes):
        for card in node.cards:
            if card.cordoned:
                found[card.index] = found.get(card.index, 0) | (1 << i)
    view.__dict__["_cordons"] = found
    return found


def _cordons_with(cordons: dict[int, int], changed: Mapping[int, Node]) -> dict[int, int]:
    """``_cordons`` after the nodes at ``changed``'s positions became its nodes (positions may be new)."""
    if not cordons and not any(c.cordoned for node in changed.values() for c in node.cards):
        return cordons  # the usual cluster: nothing cordoned before or after
    clear = 0
    for i in changed:
        clear |= 1 << i
    out = {k: bits & ~clear for k, bits in cordons.items()}
    for i, node in changed.items():
        for card in node.cards:
            if card.cordoned:
                out[card.index] = out.get(card.index, 0) | (1 << i)
    return {k: bits for k, bits in out.items() if bits}
