"""Choosing card index k for a pod over a snapshot of the cluster: binpack or spread.

A choice must stay well under a millisecond over thousands of nodes, so a view carries two
indexes, built lazily and cached on the frozen object:

- who may run where: for each distinct set of scheduling constraints (node selector, required
  node affinity, tolerations), the eligible nodes as a bitset over node positions. It depends
  only on labels, taints, readiness and cordon, so views that differ only in shares share it.
- what is free where: for each card index k and each free-share count, the bitset of nodes
  whose card k has exactly that many shares free.

A choice is then a walk over free-share counts (at most sharesPerCard + 1 of them) with one
big-integer AND each, instead of a scan of every card. ``replace_nodes`` derives a new view
from an old one by updating both indexes for the changed nodes only, as a live view needs on
every watch event. The results are exactly those of the plain scan over ``view.nodes``.
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from webhook.core import findings as f
from webhook.core import names

# Distinct constraint sets whose eligible nodes a view family keeps; pods of one workload share
# one set, so a few hundred cover a large cluster, and each entry is one big integer.
MASK_CACHE_SIZE = 256

# The preferred node-affinity term gpushard may add for the node that placement chose.
PREFERRED_WEIGHT = 100
NODE_NAME_FIELD = "metadata.name"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class Card:
    index: int
    capacity: int  # allocatable shares of gpushard.io/card-<index> (0 while unhealthy)
    used: int = 0  # shares held by non-terminal pods pinned to this card
    uuid: str = ""
    model: str = ""
    memory_mib: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    ready: bool = True
    unschedulable: bool = False
    cards: tuple[Card, ...] = ()

    def effective_taints(self) -> tuple[Taint, ...]:
        """Taints as the scheduler sees them, with cordon and not-ready made explicit."""
        extra = []
        if self.unschedulable:
            extra.append(Taint(names.UNSCHEDULABLE_TAINT, "", "NoSchedule"))
        if not self.ready:
            extra.append(Taint(names.NOT_READY_TAINT, "", "NoSchedule"))
        return self.taints + tuple(extra)


def same_scheduling(a: Node, b: Node) -> bool:
    """Whether two node states admit exactly the same pods (shares aside)."""
    # A node rebuilt for its shares keeps its labels and taints objects: no need to compare them.
    return (a.name == b.name and a.ready == b.ready and a.unschedulable == b.unschedulable
            and (a.taints is b.taints or a.taints == b.taints) and (a.labels is b.labels or a.labels == b.labels))


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


# Ask and Choice are made once or twice per admission: slots, not frozen, since a frozen
# dataclass sets each field through object.__setattr__ (a microsecond per object). Nothing
# changes them after they are made.
@dataclass(slots=True)
class Ask:
    """What placement needs to know of a pod."""

    shares: int
    pin: int | None = None
    node_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    required_terms: tuple[dict, ...] = ()  # nodeSelectorTerms, ORed
    tolerations: tuple[dict, ...] = ()


@dataclass(slots=True)
class Choice:
    card: int
    node: str | None = None  # the node whose card was chosen, when one fits
    fits: bool = False
    findings: tuple[f.Finding, ...] = ()


def _mapping(value: object, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise f.ObjectError(field, f"expected a mapping, got {type(value).__name__}")
    return value


def _dicts(value: object, field: str) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise f.ObjectError(field, "expected a list of mappings")
    return tuple(value)


def ask_from_spec(spec: dict, shares: int, pin: int | None) -> Ask:
    """Placement's view of a pod spec; scheduling fields of the wrong shape are an ObjectError."""
    affinity = _mapping(spec.get("affinity"), "spec.affinity")
    node_aff = _mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = _mapping(node_aff.get("requiredDuringSchedulingIgnoredDuringExecution"),
                        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution")
    terms = _dicts(required.get("nodeSelectorTerms"), "nodeSelectorTerms")
    for i, term in enumerate(terms):
        for part in ("matchExpressions", "matchFields"):
            for expr in _dicts(term.get(part), f"nodeSelectorTerms[{i}].{part}"):
                values = expr.get("values")
                if values is not None and (not isinstance(values, list)
                                           or not all(isinstance(v, str) for v in values)):
                    raise f.ObjectError(f"nodeSelectorTerms[{i}].{part}.values", "expected a list of strings")
    selector = _mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    node_name = spec.get("nodeName") or None
    if node_name is not None and not isinstance(node_name, str):
        raise f.ObjectError("spec.nodeName", f"expected a string, got {type(node_name).__name__}")
    return Ask(
        shares=shares,
        pin=pin,
        node_name=node_name,
        node_selector={str(k): str(v) for k, v in selector.items()},
        required_terms=terms,
        tolerations=_dicts(spec.get("tolerations"), "spec.tolerations"),
    )


def tolerates(tolerations: tuple[dict, ...], taint: Taint) -> bool:
    for tol in tolerations:
        effect = tol.get("effect") or ""
        if effect and effect != taint.effect:
            continue
        key = tol.get("key") or ""
        operator = tol.get("operator") or "Equal"
        if not key:
            if operator == "Exists":
                return True
            continue
        if key != taint.key:
            continue
        if operator == "Exists" or (tol.get("value") or "") == taint.value:
            return True
    return False


def _int(text: object) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def _expression_matches(expr: dict, values_by_key: Mapping[str, str]) -> bool:
    key = expr.get("key", "")
    op = expr.get("operator", "")
    values = expr.get("values") or []
    present = key in values_by_key
    value = values_by_key.get(key)
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        if not present or len(values) != 1:
            return False
        have, want = _int(value), _int(values[0])
        if have is None or want is None:
            return False
        return have > want if op == "Gt" else have < want
    return False


def _term_matches(term: dict, node: Node) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches no objects
    return all(_expression_matches(e, node.labels) for e in exprs if isinstance(e, dict)) and all(
        _expression_matches(e, {NODE_NAME_FIELD: node.name}) for e in fields if isinstance(e, dict)
    )


def eligible(node: Node, ask: Ask) -> bool:
    """Whether the scheduler could put the pod on this node, capacity aside."""
    if ask.node_name and node.name != ask.node_name:
        return False
    for key, value in ask.node_selector.items():
        if node.labels.get(key) != value:
            return False
    if ask.required_terms and not any(_term_matches(t, node) for t in ask.required_terms):
        return False
    for taint in node.effective_taints():
        if taint.effect in ("NoSchedule", "NoExecute") and not tolerates(ask.tolerations, taint):
            return False
    return True


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


def _lowest_bit(bits: int) -> int:
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
                    return _lowest_bit(hit), pin
            return None
        for j in order:
            free = fs[j]
            hit = by_f[free] & mask
            if hit:
                for k in self.ks:
                    found = self.by_kf[k].get(free, 0) & hit
                    if found:
                        return _lowest_bit(found), k
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


# --- the choice --------------------------------------------------------------------------------


def _warn(rule: str, message: str) -> f.Finding:
    return f.Finding(rule, f.WARN, f"gpushard: {message}")


# A choice draws uniformly among the best-fitting cards: up to CHOICE_CANDIDATES of them whose
# free shares are within CHOICE_SLACK of the best one's. Choosers whose views lag each other
# (webhook replicas, a burst of pods) then rarely pick the same card, where all of them would
# pick the one best card, and the slack keeps packing where the best card alone would (the
# figures behind these values are in docs/placement.md). 64 rather than 16: with the scheduler
# behind a burst (every pod admitted before one binds), two replicas 20 changes apart put 12 % of
# the pods on a card the other had just filled with 16 candidates, 8.5 % with 64, at the same
# packing (bench/stranding.py --behind).
CHOICE_CANDIDATES = 64
CHOICE_SLACK = 5


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


def _draw(groups: Iterable[tuple[int, int]], count: int, rng: random.Random | None) -> tuple[int, int] | None:
    """(node position, card index) drawn uniformly among the first ``count`` cards of ``groups`` (the
    first of them without ``rng``); None when there is none.

    The cards are counted a bitset at a time and only the drawn one is looked for, so a draw among
    many candidates costs about what a draw among a few did.
    """
    taken, total = [], 0
    for k, bits in groups:
        n = bits.bit_count()
        taken.append((k, bits, n))
        total += n
        if total >= count or rng is None:
            total = min(total, count)
            break
    if not total:
        return None
    r = rng.randrange(total) if rng is not None and total > 1 else 0
    for k, bits, n in taken:
        if r < n:
            while r:
                bits &= bits - 1  # drop the lowest node: the r-th of the bitset is then the lowest
                r -= 1
            return _lowest_bit(bits), k
        r -= n
    return None  # unreachable: r < total


def _waiting_index(usage: _Usage, mask: int, rng: random.Random) -> int:
    """The card index a pod that fits nowhere waits on, drawn uniformly among the indexes of the nodes
    it may run on: waiting pods then spread over the indexes, and room freed on any index finds a pod
    waiting for it, where all of them waiting on the most free card's index leave room freed on the
    others to pods that come later (the churn figures in docs/placement.md)."""
    ks = [k for k in usage.ks if usage.has_k.get(k, 0) & mask]
    return ks[rng.randrange(len(ks))]


def choose(view: View | None, ask: Ask, strategy: str = "binpack", rng: random.Random | None = None) -> Choice:
    """Pick card k for the pod. Never fails: a poor view only costs packing, not correctness.

    Without ``rng`` the best card (ties to the lower index, then the earlier node); with it, one of
    the best few (CHOICE_CANDIDATES, CHOICE_SLACK), drawn uniformly. When nothing fits, without
    ``rng`` the most free card's index; with it, an index drawn among those of the nodes the pod may
    run on (``_waiting_index``). The draw uses only ``rng``, so a
    caller that seeds it per request (as admission does, with the request's uid) leaves no trace
    on later choices.
    """
    if view is None:
        k = ask.pin if ask.pin is not None else 0
        return Choice(k, findings=(_warn(f.NO_VIEW, f"no cluster view yet; card {k} chosen without "
                                         "looking, the scheduler still enforces capacity"),))
    usage = view._usage
    mask = view._topology.mask(ask) & (usage.has_any if ask.pin is None else usage.has_k.get(ask.pin, 0))
    if not mask:
        k = ask.pin if ask.pin is not None else 0
        why = (f"no shared node with card {k} matches this pod's scheduling rules" if ask.pin is not None
               else "no shared node matches this pod's scheduling rules")
        return Choice(k, findings=(_warn(f.NO_MATCHING_NODE, f"{why}; card {k} chosen, the pod may stay Pending"),))
    if rng is not None:
        # The candidates start with search's answer, and there are none exactly when it has none.
        hit = _draw(_fitting(usage, mask, ask.pin, ask.shares, strategy, CHOICE_SLACK), CHOICE_CANDIDATES, rng)
    else:
        hit = usage.search(mask, ask.pin, ask.shares, strategy)
    if hit is None:
        _pos, k = usage.most_free(mask, ask.pin)
        if rng is not None and ask.pin is None:
            k = _waiting_index(usage, mask, rng)
        return Choice(k, findings=(_warn(
            f.NO_ROOM, f"no card has {ask.shares} free shares now; card {k} chosen, "
            "the pod stays Pending until one frees up"),))
    pos, k = hit
    return Choice(k, node=view.node(pos).name, fits=True)


# --- the soft hint for the scheduler -----------------------------------------------------------


def preferred_affinity_term(node_name: str) -> dict:
    """A preferred node-affinity term for the node whose card placement chose.

    Soft by design: the scheduler may still pick any node whose card k has room. It goes at the
    end of ``spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution``.
    ``matchFields`` on ``metadata.name`` names the node itself, where the hostname label may not.
    """
    return {"weight": PREFERRED_WEIGHT, "preference": {"matchFields": [
        {"key": NODE_NAME_FIELD, "operator": "In", "values": [node_name]}]}}


def required_node_expression(node_name: str) -> dict:
    """The ``matchFields`` expression that requires the node placement chose (policy.nodeAffinity: required)."""
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node_name]}


def without_required_node(ask: Ask, node_name: str | None) -> Ask:
    """``ask`` without the expression ``required_node_expression(node_name)`` in its required terms, as
    a pod made again from the same template would ask (gpushard's choice for it is made afresh)."""
    if node_name is None or not ask.required_terms:
        return ask
    expression = required_node_expression(node_name)
    terms, changed = [], False
    for term in ask.required_terms:
        fields = term.get("matchFields")
        if isinstance(fields, list) and expression in fields:
            changed = True
            kept = [e for e in fields if e != expression]
            term = {k: v for k, v in term.items() if k != "matchFields"} | ({"matchFields": kept} if kept else {})
            if not term.get("matchExpressions") and not term.get("matchFields"):
                continue  # the term gpushard made: nothing of the author's is left in it
        terms.append(term)
    if not changed:
        return ask
    return Ask(ask.shares, ask.pin, ask.node_name, ask.node_selector, tuple(terms), ask.tolerations)


def preferred_node(spec: dict) -> str | None:
    """The node a pod spec's preferred term names, when the term is one preferred_affinity_term wrote."""
    affinity = spec.get("affinity") if isinstance(spec, dict) else None
    node_aff = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    terms = node_aff.get("preferredDuringSchedulingIgnoredDuringExecution") if isinstance(node_aff, dict) else None
    for term in terms if isinstance(terms, list) else ():
        if not isinstance(term, dict) or term.get("weight") != PREFERRED_WEIGHT:
            continue
        pref = term.get("preference")
        if not isinstance(pref, dict) or pref.get("matchExpressions"):
            continue
        fields = pref.get("matchFields")
        if (isinstance(fields, list) and len(fields) == 1 and isinstance(fields[0], dict)
                and fields[0].get("key") == NODE_NAME_FIELD and fields[0].get("operator") == "In"
                and isinstance(fields[0].get("values"), list) and len(fields[0]["values"]) == 1
                and isinstance(fields[0]["values"][0], str)):
            return fields[0]["values"][0]
    return None


# --- memory asks: the card size first, then a card of that size ---------------------------------


def card_memory_mib(node: Node, index: int) -> int | None:
    """Card ``index``'s memory in MiB as the node's label says it (what a required affinity matches)."""
    text = node.labels.get(names.card_memory_label(index))
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 9:
        return None
    value = int(text)
    return value or None


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


@dataclass(slots=True)
class SizedChoice:
    """A card for a memory ask: ``size_mib`` is the size the shares were computed for (0: denied)."""

    card: int
    size_mib: int
    shares: int
    node: str | None = None
    fits: bool = False
    findings: tuple[f.Finding, ...] = ()
    denied: bool = False


def largest_card(view: View) -> tuple[int, str]:
    """(MiB, model) of the largest card any node's labels publish; (0, "") when none does."""
    best, model = 0, ""
    for node in view.nodes:
        for card in node.cards:
            mib = card_memory_mib(node, card.index) or 0
            if mib > best:
                best, model = mib, card.model
    return best, model


def choose_sized(view: View, ask: Ask, shares_for: Callable[[int], int], shares_per_card: int,
                 size_policy: str = "smallest", strategy: str = "binpack",
                 rng: random.Random | None = None, asked_mib: int = 0) -> SizedChoice:
    """Pick a card size and a card of that size for a memory ask.

    ``shares_for(size_mib)`` is the pod's shares on a card of that size. Sizes that hold the pod
    (at most ``shares_per_card`` shares) are tried in ``size_policy`` order; the first with a card
    that has room on a node the pod may run on wins, the card chosen among those of that size as
    ``choose`` does (binpack or spread, drawn among the best few with ``rng``). When none has room,
    the first size the pod's nodes offer, on an index drawn among them; the pod waits for it.
    """
    sizes = _sizes(view)
    held = sorted((mib for mib in sizes if shares_for(mib) <= shares_per_card),
                  reverse=size_policy == "largest")
    if not held:
        mib, model = largest_card(view)
        return SizedChoice(0, 0, 0, denied=True, findings=(f.Finding(f.MEMORY_ABOVE_CARD, f.DENY, (
            f"gpushard: the pod asks {asked_mib} MiB of GPU memory, more than the largest card holds "
            f"({model or 'a card'}, {mib} MiB); ask at most {mib}Mi") if mib else (
            "gpushard: the pod asks GPU memory, but no shared node publishes its cards' memory "
            f"(label {names.card_memory_label(0)}); ask a fraction instead, or check the agents")),),)
    usage = view._usage
    mask = view._topology.mask(ask) & usage.has_any
    waiting: tuple[int, dict[int, int]] | None = None
    for mib in held:
        masks = {k: bits & mask for k, bits in sizes[mib].items() if bits & mask}
        if not masks:
            continue
        shares = shares_for(mib)
        hit = _draw(_fitting(usage, 0, None, shares, strategy, CHOICE_SLACK if rng is not None else 0, masks),
                    CHOICE_CANDIDATES, rng)
        if hit is not None:
            pos, k = hit
            return SizedChoice(k, mib, shares, node=view.node(pos).name, fits=True)
        if waiting is None:
            waiting = (mib, masks)
    if waiting is None:
        mib = held[0]
        k = min(sizes[mib])
        return SizedChoice(k, mib, shares_for(mib), findings=(_warn(f.NO_MATCHING_NODE, (
            f"no shared node this pod may run on has a card of {mib} MiB; card {k} of that size chosen, "
            "the pod may stay Pending")),))
    mib, masks = waiting
    ks = sorted(masks)
    k = ks[rng.randrange(len(ks))] if rng is not None else ks[0]
    shares = shares_for(mib)
    return SizedChoice(k, mib, shares, findings=(_warn(f.NO_ROOM, (
        f"no card of {mib} MiB has {shares} free shares now; card {k} chosen, the pod stays Pending "
        "until one frees up")),))


def card_memory_expression(index: int, size_mib: int) -> dict:
    """The required node-affinity expression that keeps a memory ask on card ``index`` of ``size_mib``."""
    return {"key": names.card_memory_label(index), "operator": "In", "values": [str(size_mib)]}


def without_card_memory(ask: Ask, index: int) -> Ask:
    """``ask`` without the expressions on card ``index``'s memory label in its required terms, as a pod
    made again from the same template would ask (a memory ask is sized afresh when it is created)."""
    key = names.card_memory_label(index)
    terms, changed = [], False
    for term in ask.required_terms:
        exprs = term.get("matchExpressions")
        if isinstance(exprs, list) and any(isinstance(e, dict) and e.get("key") == key for e in exprs):
            changed = True
            kept = [e for e in exprs if not (isinstance(e, dict) and e.get("key") == key)]
            term = {k: v for k, v in term.items() if k != "matchExpressions"} | (
                {"matchExpressions": kept} if kept else {})
            if not term.get("matchExpressions") and not term.get("matchFields"):
                continue  # the term gpushard made: nothing of the author's is left in it
        terms.append(term)
    if not changed:
        return ask
    return Ask(ask.shares, ask.pin, ask.node_name, ask.node_selector, tuple(terms), ask.tolerations)
