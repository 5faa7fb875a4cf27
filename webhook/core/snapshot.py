"""The view placement chooses over: a read-only snapshot of the shared nodes, with its indexes.

A choice must stay well under a millisecond over thousands of nodes, so a view carries two
indexes, built lazily and cached on the frozen object:

- who may run where: for each distinct set of scheduling constraints (node selector, required
  node affinity, tolerations), the eligible nodes as a bitset over node positions. It depends
  only on labels, taints, readiness and cordon, so views that differ only in shares share it.
- what is free where: for each card index k and each free-share count, the bitset of nodes
  whose card k has exactly that many shares free.

Placement asks them through the view's queries (``candidates``, ``best``, ``fitting``,
``most_free``, ``card_indexes``, ``sizes``), which answer in bitsets over node positions
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
from collections.abc import Iterator, Mapping

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

    __hash__ = None  # nodes hold their labels in dicts

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

    def fitting(self, nodes: int, pin: int | None, shares: int, strategy: str, slack: int,
                masks: Mapping[int, int] | None = None) -> Iterator[tuple[int, int]]:
        """(card index, bitset of nodes) of the cards that fit, best first; see ``_fitting``."""
        return _fitting(self._usage, nodes, pin, shares, strategy, slack, masks)

    def card_indexes(self, nodes: int) -> list[int]:
        """The card indexes that some of ``nodes`` have, in order."""
        usage = self._usage
        return [k for k in usage.ks if usage.has_k.get(k, 0) & nodes]

    def sizes(self) -> dict[int, dict[int, int]]:
        """Card size in MiB -> card index -> the nodes whose card of that index has that size."""
        return _sizes(self)


# --- indexes -----------------------------------------------------------------------------------


# Built once: json.dumps with options builds a new encoder per call.
_KEY_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=repr)


# Keys already made, by the repr of their parts: repr is about half the price of the sorted JSON, and
# pods of one workload spell their constraints alike. Bounded in count and in the text kept.
_KEYS: dict[str, str] = {}
KEYS_KEPT = 1024
KEY_TEXT_KEPT = 2048


def _constraints_key(ask: Ask) -> str:
    """One string per distinct set of scheduling constraints (the node name aside)."""
    parts = [dict(ask.node_selector), list(ask.required_terms), list(ask.tolerations)]
    spelled = repr(parts)
    key = _KEYS.get(spelled)
    if key is not None:
        return key
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
    """Per card index and per free-share count, the bitset of nodes whose card is that free."""

    __slots__ = ("by_kf", "by_f", "has_k", "has_any", "ks", "fs")

    def __init__(self, by_kf: dict[int, dict[int, int]], by_f: dict[int, int], has_k: dict[int, int],
                 has_any: int):
        self.by_kf = by_kf  # card index -> free shares -> nodes
        self.by_f = by_f  # free shares -> nodes with some card that free
        self.has_k = has_k  # card index -> nodes that have such a card
        self.has_any = has_any  # nodes with any card
        self.ks: list[int] = []
        self.fs: list[int] = []

    @classmethod
    def build(cls, nodes: tuple[Node, ...]) -> _Usage:
        usage = cls({}, {}, {}, 0)
        for i, node in enumerate(nodes):
            usage._add(i, node)
        usage._sort()
        return usage

    def _sort(self) -> None:
        self.ks = sorted(k for k, bits in self.has_k.items() if bits)
        self.fs = sorted(self.by_f)

    def _add(self, i: int, node: Node) -> None:
        bit = 1 << i
        for card in node.cards:
            free = card.capacity - card.used
            by_f = self.by_kf.get(card.index)
            if by_f is None:
                by_f = self.by_kf[card.index] = {}
            by_f[free] = by_f.get(free, 0) | bit
            self.by_f[free] = self.by_f.get(free, 0) | bit
            self.has_k[card.index] = self.has_k.get(card.index, 0) | bit
        if node.cards:
            self.has_any |= bit

    def derive(self, old: Mapping[int, Node], new: Mapping[int, Node]) -> _Usage:
        """The index after the nodes at ``old``'s positions became ``new``'s (which may add positions).

        Copy on write: only the tables a changed card moves in are copied, so a remembered
        choice (one card's free shares) costs a few small dict copies, not the whole index.
        The result equals ``_Usage.build`` over the new nodes.
        """
        if len(old) == 1 and len(new) == 1:
            moved = self._one_card(old, new)
            if moved is not None:
                return moved
        usage = _Usage(dict(self.by_kf), self.by_f, self.has_k, self.has_any)
        copied: set[int] = set()  # card indexes whose free-share table is already ours
        fresh_f = fresh_k = False  # whether by_f, has_k are already ours
        resort_f = resort_k = False
        for i in set(old) | set(new):
            was_cards = old[i].cards if i in old else ()
            now_cards = new[i].cards if i in new else ()
            if was_cards is now_cards:
                continue
            if len(was_cards) == len(now_cards):
                # The common case (a remembered choice, a pod event): the same cards, a few of them
                # new objects. Unchanged cards are the same objects and are skipped outright.
                pairs = [(a, b) for a, b in zip(was_cards, now_cards, strict=True) if a is not b]
                if all(a.index == b.index for a, b in pairs):
                    before = {a.index: a.capacity - a.used for a, _b in pairs}
                    after = {b.index: b.capacity - b.used for _a, b in pairs}
                else:
                    before = {c.index: c.capacity - c.used for c in was_cards}
                    after = {c.index: c.capacity - c.used for c in now_cards}
            else:
                before = {c.index: c.capacity - c.used for c in was_cards}
                after = {c.index: c.capacity - c.used for c in now_cards}
            if before == after:
                continue
            bit = 1 << i
            frees: set[int] = set()  # free-share counts whose "some card that free" bit may change
            for k in set(before) | set(after):
                was, now = before.get(k), after.get(k)
                if was == now:
                    continue
                if k not in copied:
                    usage.by_kf[k] = dict(usage.by_kf.get(k, {}))
                    copied.add(k)
                table = usage.by_kf[k]
                if was is not None:
                    frees.add(was)
                    bits = table.get(was, 0) & ~bit
                    if bits:
                        table[was] = bits
                    else:
                        table.pop(was, None)
                if now is not None:
                    frees.add(now)
                    table[now] = table.get(now, 0) | bit
                if (was is None) != (now is None):
                    if not fresh_k:
                        usage.has_k = dict(usage.has_k)
                        fresh_k = True
                    usage.has_k[k] = (usage.has_k.get(k, 0) | bit) if now is not None else (usage.has_k[k] & ~bit)
                    resort_k = True
            if not fresh_f:
                usage.by_f = dict(usage.by_f)
                fresh_f = True
            held = {c.capacity - c.used for c in now_cards}
            for free in frees:
                had = free in usage.by_f
                bits = usage.by_f.get(free, 0)
                bits = (bits | bit) if free in held else (bits & ~bit)
                if bits:
                    usage.by_f[free] = bits
                else:
                    usage.by_f.pop(free, None)
                resort_f = resort_f or had != bool(bits)
            usage.has_any = (usage.has_any | bit) if now_cards else (usage.has_any & ~bit)
        usage.ks = sorted(k for k, bits in usage.has_k.items() if bits) if resort_k else self.ks
        usage.fs = sorted(usage.by_f) if resort_f else self.fs
        return usage

    def _one_card(self, old: Mapping[int, Node], new: Mapping[int, Node]) -> _Usage | None:
        """``derive`` for one node whose cards are the same but one, which changed its free shares
        (a remembered choice, most pod events); None for any other change."""
        ((i, was_node),), ((j, now_node),) = old.items(), new.items()
        was_cards, now_cards = was_node.cards, now_node.cards
        if i != j or len(was_cards) != len(now_cards) or was_cards is now_cards:
            return None
        changed = [n for n, card in enumerate(now_cards) if card is not was_cards[n]]
        if len(changed) != 1:
            return None
        a, b = was_cards[changed[0]], now_cards[changed[0]]
        k = a.index
        if b.index != k or any(c.index == k for c in now_cards if c is not b):
            return None  # a card index twice on one node: leave it to the general walk
        return self.moved(i, k, a.capacity - a.used, b.capacity - b.used, now_cards)

    def moved(self, i: int, k: int, was: int, now: int, now_cards: tuple[Card, ...]) -> _Usage:
        """The index after card ``k`` of the node at position ``i`` (its only card ``k``) went from
        ``was`` to ``now`` free shares, the node's cards now being ``now_cards``."""
        by_kf = dict(self.by_kf)
        if was == now:
            return _Usage(by_kf, self.by_f, self.has_k, self.has_any)._sorted_as(self)
        bit = 1 << i
        table = by_kf[k] = dict(by_kf.get(k, {}))
        bits = table.get(was, 0) & ~bit
        if bits:
            table[was] = bits
        else:
            table.pop(was, None)
        table[now] = table.get(now, 0) | bit
        by_f = dict(self.by_f)
        held = {c.capacity - c.used for c in now_cards}
        resort = False
        for free in (was, now):
            had = free in by_f
            bits = by_f.get(free, 0)
            bits = (bits | bit) if free in held else (bits & ~bit)
            if bits:
                by_f[free] = bits
            else:
                by_f.pop(free, None)
            resort = resort or had != bool(bits)
        usage = _Usage(by_kf, by_f, self.has_k, self.has_any | bit)
        usage.ks = self.ks
        usage.fs = sorted(by_f) if resort else self.fs
        return usage

    def _sorted_as(self, other: _Usage) -> _Usage:
        self.ks, self.fs = other.ks, other.fs
        return self

    def search(self, mask: int, pin: int | None, shares: int, strategy: str) -> tuple[int, int] | None:
        """(node position, card index) of the best card for ``shares``, or None when none fits.

        Binpack wants the least free card with room, spread the most free; ties go to the lower
        card index, then to the earlier node, exactly as the plain scan breaks them.
        """
        fs = self.fs
        if strategy == "spread":
            order = range(len(fs) - 1, bisect.bisect_left(fs, shares) - 1, -1)
        else:
            order = range(bisect.bisect_left(fs, shares), len(fs))
        return self._first(order, mask, pin)

    def most_free(self, mask: int, pin: int | None) -> tuple[int, int] | None:
        """(node position, card index) of the card with the most free shares, fitting or not."""
        return self._first(range(len(self.fs) - 1, -1, -1), mask, pin)

    def _first(self, order: range, mask: int, pin: int | None) -> tuple[int, int] | None:
        fs, by_f = self.fs, self.by_f
        if pin is not None:
            column = self.by_kf.get(pin, {})
            for j in order:
                hit = column.get(fs[j], 0) & mask
                if hit:
                    return lowest_node(hit), pin
            return None
        for j in order:
            free = fs[j]
            hit = by_f[free] & mask
            if hit:
                for k in self.ks:
                    found = self.by_kf[k].get(free, 0) & hit
                    if found:
                        return lowest_node(found), k
        return None


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
    if "_usage" in view.__dict__:  # only keep an index someone has paid for
        result.__dict__["_usage"] = view._usage.derive(old, new)
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
    if "_usage" in view.__dict__:
        result.__dict__["_usage"] = view._usage.moved(i, now.index, was.capacity - was.used,
                                                       now.capacity - now.used, node.cards)
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
    if "_usage" in view.__dict__:
        old = view._usage
        by_kf = {k: {free: b for free, bits in table.items() if (b := _drop_bits(bits, gone))}
                 for k, table in old.by_kf.items()}
        by_f = {free: b for free, bits in old.by_f.items() if (b := _drop_bits(bits, gone))}
        usage = _Usage(by_kf, by_f, {k: _drop_bits(bits, gone) for k, bits in old.has_k.items()},
                       _drop_bits(old.has_any, gone))
        usage._sort()
        result.__dict__["_usage"] = usage
    return result


def _fitting(usage: _Usage, mask: int, pin: int | None, shares: int, strategy: str, slack: int,
             masks: Mapping[int, int] | None = None) -> Iterator[tuple[int, int]]:
    """(card index, bitset of nodes) of the cards that fit, best first in ``search``'s order (free
    shares, then card index; nodes by position within a bitset), whose free shares are within
    ``slack`` of the best one's. ``masks``: per card index, the nodes to look at instead of ``mask``
    (cards of one size)."""
    fs, by_f = usage.fs, usage.by_f
    if masks is not None:
        mask = 0
        for bits in masks.values():
            mask |= bits
    if strategy == "spread":
        order = range(len(fs) - 1, bisect.bisect_left(fs, shares) - 1, -1)
    else:
        order = range(bisect.bisect_left(fs, shares), len(fs))
    best = None
    for j in order:
        free = fs[j]
        if best is not None and abs(free - best) > slack:
            return
        hit = by_f[free] & mask
        if not hit:
            continue
        for k in (pin,) if pin is not None else usage.ks:
            found = usage.by_kf.get(k, {}).get(free, 0) & hit
            if masks is not None:
                found &= masks.get(k, 0)
            if found:
                if best is None:
                    best = free
                yield k, found



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


