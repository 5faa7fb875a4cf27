"""The indexed card choice gives exactly the answers of a plain scan over every card.

We test:
- choose() equals a brute-force reference (the scan over view.nodes) on random views and pods:
  labels, taints, cordon, readiness, selectors, required affinity, tolerations, pins, shares,
  binpack and spread, fitting or not;
- the same holds for views derived by replace_nodes (shares, labels and taints changing, nodes
  added and removed), with the indexes carried over or not;
- a view shared by threads answers consistently;
- incremental index updates (a card's shares, a card more or less, any node change) leave
  exactly the index a full rebuild makes, and the same choices;
- preferred_affinity_term round-trips through preferred_node, which ignores other terms;
- a view over several chunks of nodes, derived by one card, a few nodes, many nodes, a node added
  or removed, stays the list of nodes it stands for, position by position, and chooses as the scan;
- a drawn choice (a random source) equals a draw over the plain scan's fitting cards, sorted best
  first, cut to the slack and to CHOICE_CANDIDATES, on crowded views where many cards tie, and on
  views derived from them (one card, a node changed, nodes added past the index's room, a card
  index it had no slot for, a node removed), whose index stays the one a rebuild makes;
- levels that remembered choices leave empty stay until they are half the index, then go,
  and the index keeps choosing as a rebuilt one;
- equal scheduling constraints, however spelled, share one eligibility key; different ones do not.
"""

from __future__ import annotations

import random
import threading
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.core import findings as f
from webhook.core import placement, snapshot

# --- the reference: every card of every eligible node, looked at one by one ---------------------


def reference(view: placement.View, ask: placement.Ask, strategy: str) -> placement.Choice:
    candidates = [(node, card) for node in view.nodes if placement.eligible(node, ask) for card in node.cards
                  if ask.pin is None or card.index == ask.pin]
    if not candidates:
        k = ask.pin if ask.pin is not None else 0
        return placement.Choice(k, findings=(f.NO_MATCHING_NODE,))
    fitting = [(node, card) for node, card in candidates if card.free >= ask.shares]
    if not fitting:
        _node, card = max(candidates, key=lambda nc: (nc[1].free, -nc[1].index))
        return placement.Choice(card.index, findings=(f.NO_ROOM,))
    if strategy == "spread":
        node, card = max(fitting, key=lambda nc: (nc[1].free, -nc[1].index))
    else:
        node, card = min(fitting, key=lambda nc: (nc[1].free, nc[1].index))
    return placement.Choice(card.index, node=node.name, fits=True)


def summary(choice: placement.Choice) -> tuple:
    rules = tuple(x if isinstance(x, str) else x.rule for x in choice.findings)
    return choice.card, choice.node, choice.fits, rules


# --- random views and pods ----------------------------------------------------------------------

KEYS = ["pool", "zone", "gen"]
VALUES = ["a", "b", "1", "3"]
TAINT_KEYS = ["dedicated", "gpu"]


@st.composite
def nodes(draw, name: str) -> placement.Node:
    labels = draw(st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3))
    taints = tuple(draw(st.lists(st.builds(
        placement.Taint, st.sampled_from(TAINT_KEYS), st.sampled_from(["", "x"]),
        st.sampled_from(["NoSchedule", "NoExecute", "PreferNoSchedule"])), max_size=2)))
    indexes = draw(st.lists(st.integers(0, 4), unique=True, max_size=4))
    cards = tuple(placement.Card(k, draw(st.sampled_from([0, 10, 100])), draw(st.integers(0, 110)))
                  for k in indexes)
    return placement.Node(name, labels, taints, draw(st.booleans() | st.just(True)),
                          draw(st.booleans() | st.just(False)), cards)


@st.composite
def views(draw) -> placement.View:
    count = draw(st.integers(0, 12))
    return placement.View(nodes=tuple(draw(nodes(f"n{i}")) for i in range(count)))


expressions = st.fixed_dictionaries({
    "key": st.sampled_from(KEYS),
    "operator": st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]),
    "values": st.lists(st.sampled_from(VALUES), min_size=1, max_size=2),
})
name_fields = st.fixed_dictionaries({
    "key": st.just("metadata.name"), "operator": st.sampled_from(["In", "NotIn"]),
    "values": st.lists(st.sampled_from(["n0", "n1", "n5"]), min_size=1, max_size=1)})
terms = st.fixed_dictionaries({}, optional={"matchExpressions": st.lists(expressions, max_size=2),
                                            "matchFields": st.lists(name_fields, max_size=1)})
tolerations = st.fixed_dictionaries({}, optional={
    "key": st.sampled_from(TAINT_KEYS + [placement.names.UNSCHEDULABLE_TAINT, placement.names.NOT_READY_TAINT]),
    "operator": st.sampled_from(["Equal", "Exists"]),
    "value": st.sampled_from(["", "x"]),
    "effect": st.sampled_from(["", "NoSchedule", "NoExecute"]),
})
asks = st.builds(
    placement.Ask,
    shares=st.integers(1, 100),
    pin=st.none() | st.integers(0, 5),
    node_name=st.none() | st.sampled_from(["n0", "n3", "n99"]),
    node_selector=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=2),
    required_terms=st.lists(terms, max_size=2).map(tuple),
    tolerations=st.lists(tolerations, max_size=2).map(tuple),
)
strategies = st.sampled_from(["binpack", "spread"])


@settings(max_examples=200, deadline=None)
@given(views(), st.lists(asks, min_size=1, max_size=4), strategies)
def test_choose_equals_the_plain_scan(view, pods, strategy):
    for ask in pods:  # several asks on one view also exercise the cached eligibility
        assert summary(placement.choose(view, ask, strategy)) == summary(reference(view, ask, strategy))


@st.composite
def changes(draw, view: placement.View) -> dict:
    names = [n.name for n in view.nodes] + ["n20", "n21"]
    out = {}
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=3)):
        out[name] = None if draw(st.integers(0, 5)) == 0 else draw(nodes(name))
    return out


@settings(max_examples=150, deadline=None)
@given(st.data(), views(), st.lists(asks, min_size=1, max_size=3), strategies)
def test_derived_views_equal_the_plain_scan(data, view, pods, strategy):
    warm = data.draw(st.booleans())
    for _step in range(data.draw(st.integers(1, 5))):
        if warm:  # build the indexes so that replace_nodes carries and updates them
            for ask in pods:
                placement.choose(view, ask, strategy)
        view = placement.replace_nodes(view, data.draw(changes(view)))
        names = [n.name for n in view.nodes]
        assert len(names) == len(set(names))
        for ask in pods:
            assert summary(placement.choose(view, ask, strategy)) == summary(reference(view, ask, strategy))


def test_replace_nodes_keeps_order_and_appends_new_nodes():
    a, b = placement.Node("a"), placement.Node("b", cards=(placement.Card(0, 100),))
    view = placement.View(nodes=(a, b))
    b2 = placement.Node("b", cards=(placement.Card(0, 100, 40),))
    c = placement.Node("c")
    assert placement.replace_nodes(view, {"b": b2, "c": c}).nodes == (a, b2, c)
    assert placement.replace_nodes(view, {"a": None}).nodes == (b,)
    assert placement.replace_nodes(view, {}) is view


def test_a_view_shared_by_threads_answers_the_same():
    view = placement.View(nodes=tuple(
        placement.Node(f"n{i}", {"pool": "a" if i % 3 else "b"}, cards=tuple(
            placement.Card(k, 100, (i * 7 + k * 13) % 100) for k in range(4))) for i in range(300)))
    pods = [placement.Ask(shares=s, node_selector={"pool": p}) for s in (5, 30, 90) for p in ("a", "b")]
    want = [summary(reference(view, ask, "binpack")) for ask in pods]
    got: list = []

    def work():
        got.append([summary(placement.choose(view, ask, "binpack")) for ask in pods])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [want] * 4


def test_preferred_term_round_trips():
    term = placement.preferred_affinity_term("node-7")
    spec = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}},
        term]}}}
    assert placement.preferred_node(spec) == "node-7"
    assert term["preference"]["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]
    assert placement.preferred_node({}) is None
    assert placement.preferred_node({"affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {}}]}}}) is None


# --- incremental index updates against a full rebuild ---------------------------------------------


def _usage_state(usage) -> tuple:
    """The index's content as (card index, free shares) -> nodes, whatever its layout: slots of
    card indexes with no card left and empty levels (a rebuild makes neither) and the stride aside."""
    stride = usage.layout.stride
    low = (1 << stride) - 1
    cards = {(k, free): (bits >> (s * stride)) & low
             for free, (bits, _count) in usage.levels.items() for s, k in enumerate(usage.ks)}
    # Levels left empty stay in the table, counted, until they are half of it; fs lists the others.
    assert usage.fs == sorted(free for free, (_bits, count) in usage.levels.items() if count)
    assert all(count == bits.bit_count() for bits, count in usage.levels.values())
    assert usage.empty == sum(1 for _bits, count in usage.levels.values() if not count)
    assert usage.empty <= 8 or usage.empty * 2 <= len(usage.levels)
    return ({key: nodes for key, nodes in cards.items() if nodes}, {k: b for k, b in usage.has_k.items() if b},
            usage.has_any)


@st.composite
def share_changes(draw, view: placement.View) -> dict:
    """Changes as the live view makes them: mostly one card's shares, now and then a card more or less."""
    out = {}
    for node in draw(st.lists(st.sampled_from(view.nodes), unique_by=lambda n: n.name, max_size=3)):
        cards = list(node.cards)
        action = draw(st.integers(0, 9))
        if cards and action < 7:
            j = draw(st.integers(0, len(cards) - 1))
            c = cards[j]
            cards[j] = placement.Card(c.index, c.capacity, draw(st.integers(0, 110)))
        elif action < 9:
            taken = {c.index for c in cards}
            free = [k for k in range(6) if k not in taken]
            if free:
                cards.append(placement.Card(draw(st.sampled_from(free)), 100, draw(st.integers(0, 100))))
        elif cards:
            cards.pop(draw(st.integers(0, len(cards) - 1)))
        out[node.name] = placement.Node(node.name, node.labels, node.taints, node.ready, node.unschedulable,
                                        tuple(cards))
    return out


@settings(max_examples=200, deadline=None)
@given(st.data(), views(), st.lists(asks, min_size=1, max_size=3), strategies)
def test_incremental_updates_equal_a_full_rebuild(data, view, pods, strategy):
    placement.choose(view, pods[0], strategy)  # the indexes exist, so replace_nodes updates them
    for _step in range(data.draw(st.integers(1, 8))):
        if not view.nodes:
            break
        if data.draw(st.integers(0, 4)) == 0:
            view = placement.replace_nodes(view, data.draw(changes(view)))
        else:
            view = placement.replace_nodes(view, data.draw(share_changes(view)))
        rebuilt = placement.View(nodes=view.nodes)
        assert _usage_state(view._usage) == _usage_state(rebuilt._usage)
        for ask in pods:
            assert summary(placement.choose(view, ask, strategy)) == summary(placement.choose(rebuilt, ask, strategy))
            assert summary(placement.choose(view, ask, strategy)) == summary(reference(view, ask, strategy))


# --- views over several chunks of nodes -----------------------------------------------------------


def _node_of(i: int, rng_cards: list[int]) -> placement.Node:
    return placement.Node(f"n{i}", {"pool": "a" if i % 3 else "b"}, (), True, False,
                          tuple(placement.Card(k, 100, used) for k, used in enumerate(rng_cards)))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(placement.CHUNK - 3, 3 * placement.CHUNK + 5), strategies)
def test_views_over_several_chunks_stay_the_list_they_stand_for(data, count, strategy):
    model = [_node_of(i, [data.draw(st.integers(0, 100)) for _ in range(2)]) for i in range(count)]
    view = placement.View(nodes=tuple(model))
    pods = [placement.Ask(shares=25), placement.Ask(shares=60, pin=1),
            placement.Ask(shares=10, node_selector={"pool": "b"})]
    placement.choose(view, pods[0], strategy)  # the indexes exist, so derived views carry them
    for step in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["card", "few", "many", "add", "remove"]))
        if kind == "card":  # a remembered choice: one card of one node
            i = data.draw(st.integers(0, len(model) - 1))
            node = model[i]
            if not node.cards:
                continue
            cards = list(node.cards)
            cards[0] = placement.Card(cards[0].index, cards[0].capacity, data.draw(st.integers(0, 100)))
            model[i] = placement.Node(node.name, node.labels, node.taints, node.ready, node.unschedulable,
                                      tuple(cards))
            view = placement.replace_card(view, model[i], 0)
        elif kind in ("few", "many"):
            size = data.draw(st.integers(1, placement.FEW_CHANGES) if kind == "few"
                             else st.integers(placement.FEW_CHANGES + 1, 3 * placement.FEW_CHANGES))
            changed = {}
            for i in data.draw(st.lists(st.integers(0, len(model) - 1), unique=True, min_size=1, max_size=size)):
                model[i] = _node_of(int(model[i].name[1:]), [data.draw(st.integers(0, 100)) for _ in range(2)])
                changed[model[i].name] = model[i]
            view = placement.replace_nodes(view, changed)
        elif kind == "add":
            model.append(_node_of(1000 + step, [0, 50]))
            view = placement.replace_nodes(view, {model[-1].name: model[-1]})
        elif len(model) > 1:
            gone = model.pop(data.draw(st.integers(0, len(model) - 1)))
            view = placement.replace_nodes(view, {gone.name: None})
        assert view.size == len(model)
        assert [view.node(i) for i in range(view.size)] == model
        assert view.nodes == tuple(model)
        for ask in pods:
            assert summary(placement.choose(view, ask, strategy)) == summary(reference(view, ask, strategy))


# --- the drawn choice against a plain scan ----------------------------------------------------------


def reference_draw(view: placement.View, ask: placement.Ask, strategy: str, rng) -> tuple:
    """The drawn choice, card by card: every fitting card sorted best first (free shares, then card
    index, then node position), those within CHOICE_SLACK of the best, the first CHOICE_CANDIDATES
    of them, one drawn; when none fits, the waiting index drawn among the nodes' card indexes."""
    nodes = [(i, node) for i, node in enumerate(view.nodes) if placement.eligible(node, ask) and node.cards]
    cards = [(i, node, card) for i, node in nodes for card in node.cards if ask.pin is None or card.index == ask.pin]
    if not cards:
        k = ask.pin if ask.pin is not None else 0
        return k, None, False, (f.NO_MATCHING_NODE,)
    fitting = [(i, node, card) for i, node, card in cards if card.free >= ask.shares]
    if not fitting:
        if ask.pin is not None:
            return ask.pin, None, False, (f.NO_ROOM,)
        ks = sorted({card.index for _i, _node, card in cards})
        return ks[rng.randrange(len(ks))], None, False, (f.NO_ROOM,)
    sign = -1 if strategy == "spread" else 1
    fitting.sort(key=lambda c: (sign * c[2].free, c[2].index, c[0]))
    best = fitting[0][2].free
    drawn = [c for c in fitting if abs(c[2].free - best) <= placement.CHOICE_SLACK][:placement.CHOICE_CANDIDATES]
    _i, node, card = drawn[rng.randrange(len(drawn)) if len(drawn) > 1 else 0]
    return card.index, node.name, True, ()


@st.composite
def crowded_views(draw) -> placement.View:
    """Up to 150 nodes of up to 6 cards whose free shares fall on a few values, so that many cards
    tie and a draw meets the CHOICE_CANDIDATES cap and the slack."""
    count = draw(st.integers(1, 150))
    used = st.sampled_from([0, 2, 5, 7, 40, 41, 44, 47, 90, 100])
    out = []
    for i in range(count):
        indexes = draw(st.sets(st.integers(0, 5), max_size=6)) if i % 7 == 0 else range(draw(st.integers(0, 6)))
        out.append(placement.Node(f"n{i}", {"pool": "a" if i % 3 else "b"}, (), True, i % 11 == 5,
                                  tuple(placement.Card(k, 100, draw(used)) for k in sorted(indexes))))
    return placement.View(nodes=tuple(out))


crowded_asks = st.builds(placement.Ask, shares=st.sampled_from([1, 5, 10, 50, 60, 100]),
                         pin=st.none() | st.integers(0, 6),
                         node_selector=st.sampled_from([{}, {"pool": "a"}, {"pool": "b"}]),
                         tolerations=st.sampled_from([(), ({"operator": "Exists"},)]))


@settings(max_examples=150, deadline=None)
@given(crowded_views(), st.lists(crowded_asks, min_size=1, max_size=3), strategies, st.integers(0, 2**32))
def test_a_drawn_choice_equals_the_plain_scan_draw(view, pods, strategy, seed):
    for n, ask in enumerate(pods):
        got = placement.choose(view, ask, strategy, random.Random(seed + n))
        assert summary(got) == reference_draw(view, ask, strategy, random.Random(seed + n))


@settings(max_examples=60, deadline=None)
@given(st.data(), crowded_views(), strategies)
def test_derived_views_draw_as_the_plain_scan(data, view, strategy):
    """Remembered choices (one card), node changes, nodes added past the index's room for them and
    card indexes it has no slot for, each followed by drawn choices against the plain scan."""
    pods = [placement.Ask(shares=5), placement.Ask(shares=40, pin=2),
            placement.Ask(shares=10, node_selector={"pool": "b"})]
    placement.choose(view, pods[0], strategy)  # the indexes exist, so derived views carry them
    for step in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["card", "card", "node", "add", "new index", "remove"]))
        names = [n.name for n in view.nodes]
        if kind == "card" and names:
            node = view.node(data.draw(st.integers(0, len(names) - 1)))
            if node.cards:
                j = data.draw(st.integers(0, len(node.cards) - 1))
                c = node.cards[j]
                cards = (*node.cards[:j], placement.Card(c.index, c.capacity, data.draw(st.integers(0, 100))),
                         *node.cards[j + 1:])
                view = placement.replace_card(view, placement.Node(node.name, node.labels, node.taints, node.ready,
                                                                   node.unschedulable, cards), j)
        elif kind == "node" and names:
            name = data.draw(st.sampled_from(names))
            view = placement.replace_nodes(view, {name: placement.Node(name, {"pool": "b"}, cards=tuple(
                placement.Card(k, 100, data.draw(st.integers(0, 100))) for k in range(data.draw(st.integers(0, 4)))))})
        elif kind == "add":
            added = {f"a{step}-{i}": placement.Node(f"a{step}-{i}", cards=(placement.Card(0, 100, 50),))
                     for i in range(data.draw(st.integers(1, 40)))}
            view = placement.replace_nodes(view, added)
        elif kind == "new index" and names:
            name = data.draw(st.sampled_from(names))
            view = placement.replace_nodes(view, {name: placement.Node(name, cards=(placement.Card(9, 100, 1),))})
        elif kind == "remove" and len(names) > 1:
            view = placement.replace_nodes(view, {data.draw(st.sampled_from(names)): None})
        rebuilt = placement.View(nodes=view.nodes)
        assert _usage_state(view._usage) == _usage_state(rebuilt._usage)
        seed = data.draw(st.integers(0, 2**32))
        for n, ask in enumerate(pods):
            got = placement.choose(view, ask, strategy, random.Random(seed + n))
            assert summary(got) == reference_draw(view, ask, strategy, random.Random(seed + n))


def test_levels_left_empty_by_remembered_choices_are_dropped_once_they_are_half_the_table():
    view = placement.View(nodes=tuple(_node_of(i, [10 * i, 5]) for i in range(3)))
    pods = [placement.Ask(shares=s) for s in (1, 30, 90)]
    placement.choose(view, pods[0])  # the indexes exist, so each remembered choice moves one card
    sizes = []
    for step in range(300):  # cards filled a share at a time, then emptied: level after level empties
        i, j = step % 3, (step // 3) % 2
        node = view.node(i)
        c = node.cards[j]
        used = (c.used + 1) % 101 if step < 240 else 0
        view = placement.replace_card(view, node.with_card(j, c.with_used(used)), j)
        sizes.append(len(view._usage.levels))
        assert _usage_state(view._usage) == _usage_state(placement.View(nodes=view.nodes)._usage)
        for ask in pods:
            for seed in (1, 2):
                got = placement.choose(view, ask, "binpack", random.Random(seed))
                assert summary(got) == reference_draw(view, ask, "binpack", random.Random(seed))
    live = {c.capacity - c.used for n in view.nodes for c in n.cards}
    assert max(sizes) <= 2 * 6 + 9 and len(view._usage.levels) <= len(live) + 9


def test_equal_scheduling_constraints_share_one_key_and_different_ones_do_not():
    key = snapshot._constraints_key
    gpu = ({"key": "gpu", "operator": "Exists"},)
    assert key(placement.Ask(1, tolerations=gpu)) == key(placement.Ask(5, pin=2, tolerations=(
        {"operator": "Exists", "key": "gpu"},)))  # the same toleration, its fields in another order
    assert key(placement.Ask(1)) == key(placement.Ask(1, node_selector={}, required_terms=(), tolerations=()))
    no_schedule = ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},)
    assert len({key(placement.Ask(1)), key(placement.Ask(1, tolerations=gpu)),
                key(placement.Ask(1, node_selector={"pool": "a"})), key(placement.Ask(1, node_selector={"pool": "b"})),
                key(placement.Ask(1, required_terms=({"matchExpressions": [{"key": "pool", "operator": "Exists"}]},))),
                key(placement.Ask(1, tolerations=no_schedule))}) == 6
    proxied = placement.Ask(1, node_selector=types.MappingProxyType({"pool": "a"}))
    assert key(proxied) == key(placement.Ask(1, node_selector={"pool": "a"}))
